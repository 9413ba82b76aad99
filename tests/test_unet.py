"""guided-diffusion's UNet in Flax (`pcsr_jax.models.unet`): agreement with the PyTorch reference written from the
official code (benchmarks/torch_methods/guided_unet.py) on random weights, forward and gradient to the input; the
conversion of an official-format state dict (convert_weights.py --unet-config) and `checkpoint.load`; bad input;
the bf16 option; where the gradient checkpoints are."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import convert_weights
from pcsr_jax import checkpoint
from pcsr_jax.errors import UserError
from pcsr_jax.models.unet import UNet, UNetConfig, param_shapes
from pcsr_jax.weights import guided_diffusion as gd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two levels (32 and 16 px, widths 32 and 64), attention at 16 px and in the middle, learn_sigma.
SMALL = dict(image_size=32, num_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(16,),
             out_channels=6)
CONFIGS = {
    # The DDA model's options: ResBlock up/down, scale-shift norm, legacy attention, num_head_channels.
    "updown-scaleshift": UNetConfig(**SMALL, num_head_channels=16, resblock_updown=True, use_scale_shift_norm=True),
    # The others: strided-conv down / nearest+conv up, additive embedding, the new attention order with
    # num_heads and num_heads_upsample, the class embedding.
    "conv-additive": UNetConfig(**SMALL, num_heads=2, num_heads_upsample=4, resblock_updown=False,
                                use_scale_shift_norm=False, use_new_attention_order=True, class_cond=True),
}
# The guided-diffusion flags of CONFIGS["updown-scaleshift"], as a user writes them.
SMALL_FLAGS = dict(image_size=32, num_channels=32, channel_mult="1,2", num_res_blocks=1, attention_resolutions="16",
                   num_head_channels=16, learn_sigma=True, resblock_updown=True, use_scale_shift_norm=True)


def inputs(cfg: UNetConfig, batch: int = 2, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, (batch, cfg.image_size, cfg.image_size, cfg.in_channels)).astype(np.float32)
  t = np.array([0, 999, 505, 17][:batch], np.int32)
  y = np.array([3, 998, 0, 7][:batch], np.int32) if cfg.class_cond else None
  cot = rng.standard_normal((batch, cfg.image_size, cfg.image_size, cfg.out_channels)).astype(np.float32)
  return x, t, y, cot


@functools.lru_cache(maxsize=None)
def forward_and_input_grad(cfg: UNetConfig):
  """Jitted ``(params, x, t, y, cot) -> (out, d<out, cot>/dx)``."""

  def f(params, x, t, y, cot):
    out, vjp = jax.vjp(lambda x: UNet(cfg).apply({"params": params}, x, t, y), x)
    return out, vjp(cot)[0]

  return jax.jit(f)


def torch_reference(cfg: UNetConfig, seed: int = 0):
  """The reference model with random weights everywhere (its zeroed output convs too) and its state dict."""
  from benchmarks.torch_methods import guided_unet

  model = guided_unet.randomize_(guided_unet.build(cfg), seed).eval()
  return model, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def torch_forward_and_input_grad(model, x, t, y, cot):
  import torch

  xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_(True)
  out = model(xt, torch.from_numpy(t).long(), None if y is None else torch.from_numpy(y).long())
  (out * torch.from_numpy(cot.transpose(0, 3, 1, 2).copy())).sum().backward()
  return out.detach().numpy().transpose(0, 2, 3, 1), xt.grad.numpy().transpose(0, 2, 3, 1)


def rel_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_the_pytorch_reference_forward_and_input_gradient(name):
  """float32, matmul precision highest, random weights: the output and the gradient of <out, cot> w.r.t. the
  input (what DDA backpropagates to x_t) within 1e-4 of the largest value. Both sides are float32 throughout;
  what differs is the summation order of the convolutions (XLA vs oneDNN), the attention einsums and the
  GroupNorm reductions, about 1e-7 relative per layer over ~40 layers; measured 2e-6 (output) and 5e-6
  (gradient) here. A wrong layer (cos/sin swapped, the other qkv order, scale and shift exchanged, the down
  ResBlock pooling after its conv) is off by 0.13 to 0.72 of the largest value."""
  cfg = CONFIGS[name]
  model, sd = torch_reference(cfg)
  params = gd.torch_to_flax(sd, cfg)
  x, t, y, cot = inputs(cfg)
  out, gx = forward_and_input_grad(cfg)(params, x, t, y, cot)
  ref_out, ref_gx = torch_forward_and_input_grad(model, x, t, y, cot)
  assert out.shape == (2, 32, 32, 6) and out.dtype == jnp.float32
  assert rel_err(out, ref_out) < 1e-4, rel_err(out, ref_out)
  assert rel_err(gx, ref_gx) < 1e-4, rel_err(gx, ref_gx)


def write_flags(tmp_path, **overrides) -> str:
  path = tmp_path / "flags.json"
  path.write_text(json.dumps({**SMALL_FLAGS, **overrides}))
  return str(path)


@pytest.mark.torch
def test_convert_a_torch_state_dict_and_load_it(tmp_path):
  """convert_weights.py's main on a torch.save'd state dict of the reference, then checkpoint.load: the params
  are the direct conversion's bit for bit, the metadata records the config and the diffusion settings, and
  the loaded params go back into the reference with strict=True."""
  import torch

  cfg = CONFIGS["updown-scaleshift"]
  model, sd = torch_reference(cfg, seed=1)
  torch.save(model.state_dict(), str(tmp_path / "model.pt"))
  assert convert_weights.main([str(tmp_path / "model.pt"), "--out", str(tmp_path / "ck"),
                               "--unet-config", write_flags(tmp_path)]) == 0
  loaded, params, meta = checkpoint.load(str(tmp_path / "ck"))
  assert isinstance(loaded, UNet) and loaded.config == cfg
  assert meta["kind"] == "unet" and meta["model"] == cfg.to_dict() and meta["img_size"] == 32
  assert meta["diffusion"]["learn_sigma"] is True and meta["diffusion"]["diffusion_steps"] == 1000
  assert meta["diffusion"]["noise_schedule"] == "linear"
  direct = gd.torch_to_flax(sd, cfg)
  jax.tree.map(np.testing.assert_array_equal, params, direct)
  back = gd.flax_to_torch(params)
  model.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
  for k, v in sd.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  with pytest.raises(UserError, match="a unet checkpoint, expected a vit one"):
    checkpoint.load(str(tmp_path / "ck"), kind="vit")


def test_checkpoint_load_checks_a_diffusion_checkpoint(tmp_path):
  """The ViT checkpoints' checks on a diffusion checkpoint: names, shapes, finiteness, the metadata's fields."""
  cfg = CONFIGS["conv-additive"]
  params = random_params(cfg)
  diffusion = dict(learn_sigma=True, diffusion_steps=1000, noise_schedule="linear")
  checkpoint.save(str(tmp_path / "ok"), params, checkpoint.make_unet_meta(cfg, diffusion))
  model, loaded, meta = checkpoint.load(str(tmp_path / "ok"), kind="unet")
  assert model.config == cfg and meta["diffusion"] == diffusion
  jax.tree.map(np.testing.assert_array_equal, loaded, params)

  def fails(match, params, meta):
    d = str(tmp_path / f"bad{len(os.listdir(tmp_path))}")
    checkpoint.save(d, params, meta)
    with pytest.raises(UserError, match=match) as e:
      checkpoint.load(d)
    assert "\n" not in str(e.value)

  meta = checkpoint.make_unet_meta(cfg, diffusion)
  nan = jax.tree.map(np.array, params)
  nan["middle_block_1"]["qkv"]["kernel"][0, 0] = np.nan
  fails(r"1 param arrays hold NaN or inf \(e.g. middle_block_1/qkv/kernel\)", nan, meta)
  fails(r"params do not match the metadata's model \(UNet, 32 px, num_channels 32, channel_mult \[1, 2\]\): "
        r"missing label_emb/embedding", {k: v for k, v in params.items() if k != "label_emb"}, meta)
  wrong = {**params, "out_2": {**params["out_2"], "bias": np.zeros(3, np.float32)}}
  fails(r"out_2/bias has shape \(3,\), the metadata's model needs \(6,\)", wrong, meta)
  fails("says learn_sigma False but its model has 6 output channels", params,
        checkpoint.make_unet_meta(cfg, {**diffusion, "learn_sigma": False}))
  fails("'diffusion' must be an object with keys", params, {**meta, "diffusion": {"learn_sigma": True}})
  fails(r"bad model config \(UNet config: unexpected keys \['depth'\]\)", params,
        {**meta, "model": {**meta["model"], "depth": 12}})


def test_published_configs_resolve():
  cfg, diffusion = gd.config_from_flags(gd.read_flags("256x256_diffusion_uncond")[0])
  assert cfg == UNetConfig(image_size=256, num_channels=256, out_channels=6, num_res_blocks=2,
                           attention_resolutions=(32, 16, 8), channel_mult=(1, 1, 2, 2, 4, 4), num_heads=4,
                           num_head_channels=64, use_scale_shift_norm=True, resblock_updown=True)
  assert diffusion["diffusion_steps"] == 1000 and diffusion["noise_schedule"] == "linear" and diffusion["learn_sigma"]
  # The size papers that use this checkpoint report (DDFM, CCF: 552.81M), from the shapes alone.
  assert round(sum(int(np.prod(s)) for s in gd.expected_shapes(cfg).values()) / 1e6, 2) == 552.81
  assert gd.config_from_flags(gd.read_flags("512x512_diffusion")[0])[0].channel_mult == (0.5, 1, 1, 2, 2, 4, 4)
  assert gd.config_from_flags(gd.read_flags("64x64_diffusion")[0])[1]["noise_schedule"] == "cosine"
  for name in gd.PUBLISHED:
    gd.config_from_flags(gd.read_flags(name)[0])


def random_params(cfg: UNetConfig, seed: int = 0) -> dict:
  """Random params of every layer without compiling an init: kernels N(0, 1/fan_in), GroupNorm scales in
  [0.5, 1.5], biases N(0, 0.1), the label embedding N(0, 1)."""
  rng = np.random.default_rng(seed)

  def draw(path, s):
    if path[-1].key == "kernel":
      return (rng.standard_normal(s.shape) / np.sqrt(np.prod(s.shape[:-1]))).astype(np.float32)
    if path[-1].key == "scale":
      return rng.uniform(0.5, 1.5, s.shape).astype(np.float32)
    return rng.standard_normal(s.shape).astype(np.float32) * (1.0 if path[-1].key == "embedding" else 0.1)

  return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))


@pytest.fixture(scope="module")
def small_state_dict():
  """An official-format state dict of CONFIGS['updown-scaleshift'] (no torch needed)."""
  return gd.flax_to_torch(random_params(CONFIGS["updown-scaleshift"]))


def fails(match: str, tmp_path, sd, **flag_overrides):
  from safetensors.numpy import save_file

  save_file(sd, str(tmp_path / "m.safetensors"))
  with pytest.raises(UserError, match=match) as e:
    convert_weights.main([str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "out"),
                          "--unet-config", write_flags(tmp_path, **flag_overrides)])
  assert "\n" not in str(e.value)
  assert not (tmp_path / "out").exists()


def test_bad_state_dicts_and_configs_name_the_key_or_flag(small_state_dict, tmp_path):
  sd = dict(small_state_dict)
  fails(r"missing keys \['middle_block.1.proj_out.bias'\]", tmp_path,
        {k: v for k, v in sd.items() if k != "middle_block.1.proj_out.bias"})
  fails(r"unexpected keys \['middle_block.1.extra.weight'\]", tmp_path,
        {**sd, "middle_block.1.extra.weight": np.zeros(3, np.float32)})
  fails(r"shape mismatch for 'output_blocks.0.0.skip_connection.weight': checkpoint \(64, 128\), the UNet config "
        r"expects \(64, 128, 1, 1\)", tmp_path,
        {**sd, "output_blocks.0.0.skip_connection.weight": np.zeros((64, 128), np.float32)})
  fails(r"2 tensors hold NaN or inf", tmp_path,
        {**sd, "out.2.bias": np.full(6, np.nan, np.float32), "out.0.weight": np.full(32, np.inf, np.float32)})
  fails(r"unknown keys \['num_chanels'\]", tmp_path, sd, num_chanels=32)
  fails(r"num_channels 64 does not fit the checkpoint: time_embed.0.weight \(128, 32\)", tmp_path, sd, num_channels=64)
  fails("learn_sigma False does not fit the checkpoint: out.2.weight", tmp_path, sd, learn_sigma=False)
  fails("class_cond True does not fit the checkpoint: it lacks label_emb.weight", tmp_path, sd, class_cond=True)
  fails(r"num_res_blocks 2 x 2 levels .* make 6 input blocks, the checkpoint has 4", tmp_path, sd, num_res_blocks=2)
  fails(r"channel_mult \[1, 1\] does not fit the checkpoint: input_blocks.3.0.out_layers.3.weight", tmp_path, sd,
        channel_mult="1,1")
  fails("resblock_updown false does not fit the checkpoint: input_blocks.2.0.in_layers.0.weight", tmp_path, sd,
        resblock_updown=False)
  fails("use_scale_shift_norm False does not fit the checkpoint", tmp_path, sd, use_scale_shift_norm=False)
  fails(r"attention_resolutions \[32\] does not fit the checkpoint: its input blocks have attention at \[16\] px",
        tmp_path, sd, attention_resolutions="32")
  fails("num_head_channels 24: does not divide attention width", tmp_path, sd, num_head_channels=24)
  fails("learn_sigma must be true or false", tmp_path, sd, learn_sigma="True")
  fails("noise_schedule must be one of", tmp_path, sd, noise_schedule="quadratic")


def test_cli_exit_code_and_one_line(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "convert_weights.py"), "x.pt", "--out", str(tmp_path / "o"),
                      "--unet-config", '{"image_size": 32, "learn_sigmaa": true}'],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "unknown keys ['learn_sigmaa']" in r.stderr, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr
  with pytest.raises(UserError, match="--arch: not used with --unet-config"):
    convert_weights.main(["x.pt", "--out", str(tmp_path / "o"), "--unet-config", "256x256_diffusion_uncond",
                          "--arch", "vit_base_patch16_224"])


def test_bfloat16_stays_close_to_float32():
  """dtype='bfloat16' (the official's use_fp16 with bf16): the torso's convolutions and attention in bf16,
  norms, the embedding MLP and the output layers in float32. bf16 keeps 8 bits of mantissa (relative rounding
  4e-3 per op); over the ~40 layers, with GroupNorm renormalizing, the output stays within 5% of its largest
  value of the float32 one (measured 1.6%). It must differ at all: a bf16 path that silently ran in float32
  would agree to 1e-6."""
  cfg = CONFIGS["updown-scaleshift"]
  params = random_params(cfg, seed=3)
  x, t, y, cot = inputs(cfg)
  f32 = forward_and_input_grad(cfg)(params, x, t, y, cot)[0]  # the parity test's compiled program
  bf16 = jax.jit(lambda p: UNet(dataclasses.replace(cfg, dtype="bfloat16")).apply({"params": p}, x, t))(params)
  assert bf16.dtype == jnp.float32
  err = rel_err(bf16, f32)
  assert 1e-4 < err < 5e-2, err


def test_checkpoints_wrap_attention_always_and_resblocks_with_use_checkpoint():
  """jax.checkpoint on every attention block (the official always checkpoints them) and, with use_checkpoint, on
  every ResBlock: counted in the traced program."""
  cfg = CONFIGS["updown-scaleshift"]
  params = param_shapes(cfg)
  x, t, _, _ = inputs(cfg)
  count = lambda c: len(re.findall(r"= (?:checkpoint|remat\d*)\[", str(jax.make_jaxpr(
      lambda p: UNet(c).apply({"params": p}, x, t))(params))))
  # Attention: 1 input block, the middle block, 2 output blocks. ResBlocks: 3 input, 2 middle, 5 output.
  assert count(cfg) == 4
  assert count(dataclasses.replace(cfg, use_checkpoint=True)) == 4 + 10


@pytest.mark.slow
@pytest.mark.torch
def test_full_256_uncond_model_matches_the_pytorch_reference():
  """DDA's model (256x256_diffusion_uncond's flags, 553M params) once, random weights, batch 1: the forward of
  the JAX model against the reference's, float32. The bound is the small configs' 1e-4 of the largest value.

  The input is 64 px, not 256: the layers, their weights and where attention sits are fixed by the config's
  ``image_size`` (256), not by the input, so every module still runs (at 2 px in the lowest level) at 1/16 of
  the full-size forward's time."""
  import torch

  cfg, _ = gd.config_from_flags(gd.read_flags("256x256_diffusion_uncond")[0])
  model, sd = torch_reference(cfg)
  params = gd.torch_to_flax(sd, cfg)
  del sd
  x, t, _, _ = inputs(dataclasses.replace(cfg, image_size=64), batch=1)
  t = np.array([505], np.int32)
  with torch.no_grad():
    ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(t).long()).numpy()
  del model
  out = jax.jit(lambda p, x, t: UNet(cfg).apply({"params": p}, x, t))(params, x, t)
  assert rel_err(out, ref.transpose(0, 2, 3, 1)) < 1e-4


def test_a_diffusion_checkpoint_given_as_the_classifier_is_one_line(tmp_path):
  """The main job's ``--checkpoint`` takes a ViT: a diffusion checkpoint there is refused before any work."""
  from pcsr_jax.experiments import imagenet_c

  cfg = CONFIGS["updown-scaleshift"]
  d = str(tmp_path / "unet")
  checkpoint.save(d, random_params(cfg), checkpoint.make_unet_meta(cfg, dict(learn_sigma=True, diffusion_steps=1000,
                                                                               noise_schedule="linear")))
  with pytest.raises(UserError, match=re.escape(f"{d}: a unet checkpoint, expected a vit one")):
    imagenet_c.main(["--checkpoint", d, "--methods", "source", "--images", "8", "--output", str(tmp_path / "r")])


@pytest.mark.parametrize("kernel,stride", [(3, 1), (3, 2), (1, 1)])
def test_conv_as_matmuls_equals_xlas_convolution(kernel, stride):
  """`Conv`'s 'dots' (im2col matmuls, the CPU default) and 'xla' (XLA's convolution): the same params, and the
  same output and input gradient up to float32 summation order (1e-5 of the largest value; a window shifted by
  one pixel, or the kernel's taps read in another order, is off by about 1). A 3x3 stride-2 conv is the
  downsampling block's; 1x1 the skip's."""
  from pcsr_jax.models.unet import Conv

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 8, 8, 5)), jnp.float32)
  params = Conv(7, kernel, stride, impl="xla").init(jax.random.key(0), x)["params"]
  params = {"kernel": params["kernel"], "bias": jnp.asarray(rng.standard_normal(7), jnp.float32)}
  results = {}
  for impl in ("xla", "dots"):
    assert jax.tree.map(jnp.shape, Conv(7, kernel, stride, impl=impl).init(jax.random.key(0), x)["params"]) == \
        jax.tree.map(jnp.shape, params)
    out, vjp = jax.vjp(lambda x: Conv(7, kernel, stride, impl=impl).apply({"params": params}, x), x)
    results[impl] = (out, vjp(jnp.ones_like(out) * jnp.arange(7.0))[0])
  (out_x, g_x), (out_d, g_d) = results["xla"], results["dots"]
  assert out_d.shape == out_x.shape == (2, 8 // stride, 8 // stride, 7)
  assert rel_err(out_d, out_x) < 1e-5 and rel_err(g_d, g_x) < 1e-5, (rel_err(out_d, out_x), rel_err(g_d, g_x))


@pytest.mark.parametrize("shape", [(2, 6, 6, 64), (3, 10, 96)])
def test_group_norm_from_channel_sums_equals_the_grouped_form(shape):
  """`GroupNorm32`'s 'sums' (per-channel sums, closed-form backward; DDA's on a CPU) and 'xla' (the grouped
  reshape, autodiff): the same output and gradients of the input, scale and bias up to float32 summation order
  (1e-5 of the largest value), on NHWC and on the attention block's ``[B, T, C]``; inputs far from zero mean,
  per-channel scales. Statistics over the wrong channels (two groups' channels swapped, a channel's group
  normalized by its neighbour's mean) are off by about 1."""
  from pcsr_jax.models.unet import GroupNorm32

  rng = np.random.default_rng(0)
  c = shape[-1]
  x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.5, 3, c) + rng.uniform(-2, 2, c), jnp.float32)
  params = {"scale": jnp.asarray(rng.uniform(0.5, 1.5, c), jnp.float32),
            "bias": jnp.asarray(rng.standard_normal(c), jnp.float32)}
  cot = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  results = {}
  for impl in ("xla", "sums"):
    out, vjp = jax.vjp(lambda p, x: GroupNorm32(impl).apply({"params": p}, x), params, x)
    dp, dx = vjp(cot)
    results[impl] = (out, dx, dp["scale"], dp["bias"])
  for got, want in zip(results["sums"], results["xla"]):
    assert got.shape == want.shape and rel_err(got, want) < 1e-5, rel_err(got, want)
  # Channels (and their params) moved by one: each group then mixes two of the original groups.
  shuffled = GroupNorm32("sums").apply({"params": jax.tree.map(lambda p: jnp.roll(p, 1), params)},
                                       jnp.roll(x, 1, axis=-1))
  assert rel_err(jnp.roll(shuffled, -1, axis=-1), results["xla"][0]) > 1e-2


def test_unet_with_group_norm_from_channel_sums_equals_the_default():
  """The whole UNet (DDA's config kind: scale-shift norms, up/down ResBlocks, attention) with 'dots' and 'sums'
  (what DDA runs on a CPU) against 'xla' for both: output and input gradient within 1e-5 relative."""
  cfg = CONFIGS["updown-scaleshift"]
  x, t, _, cot = inputs(cfg)
  params = random_params(cfg)
  results = {}
  for conv, norm in (("xla", "xla"), ("dots", "sums")):
    out, vjp = jax.vjp(lambda x: UNet(cfg, conv=conv, norm=norm).apply({"params": params}, x, t), x)
    results[norm] = (out, vjp(cot)[0])
  for got, want in zip(results["sums"], results["xla"]):
    assert rel_err(got, want) < 1e-5, rel_err(got, want)


def test_dda_takes_the_matmul_convolutions_on_a_cpu_and_a_bad_name_is_one_line():
  """DDA's UNet runs its convolutions as matmuls and its GroupNorms from channel sums in a step built for a CPU,
  XLA's own in one built for a GPU or TPU, the checkpoint's module otherwise unchanged; an unknown ``conv`` or
  ``norm`` is a one-line error naming the field."""
  from pcsr_jax.methods import dda
  from tiny import tiny_model

  cfg = CONFIGS["updown-scaleshift"]
  meta = {"kind": "unet", "diffusion": {"diffusion_steps": 1000}}
  prep = dda.DDA().prepare_with(tiny_model()[0], None, UNet(cfg), param_shapes(cfg), meta)
  on_cpu = dda.DDA.unet_for(dataclasses.replace(prep, platform="cpu"))
  assert UNet(cfg).conv == "xla" and on_cpu.conv == "dots" and on_cpu.config == cfg
  assert UNet(cfg).norm == "xla" and on_cpu.norm == "sums"
  for platform in ("gpu", "tpu"):
    elsewhere = dda.DDA.unet_for(dataclasses.replace(prep, platform=platform))
    assert (elsewhere.conv, elsewhere.norm) == ("xla", "xla")
  x, t, _, _ = inputs(cfg)
  with pytest.raises(UserError, match="^conv: expected one of xla, dots, got 'cudnn'"):
    jax.eval_shape(lambda p: UNet(cfg, conv="cudnn").apply({"params": p}, x, t), param_shapes(cfg))
  with pytest.raises(UserError, match="^norm: expected one of xla, sums, got 'fused'"):
    jax.eval_shape(lambda p: UNet(cfg, norm="fused").apply({"params": p}, x, t), param_shapes(cfg))
