"""DDA (`pcsr_jax.methods.dda`): the method through the engine on a tiny ViT with a stand-in eps model in the
UNet's place (`tiny.StandInUNet`), its ensemble modes against a transcription of the official ones, the official
save-as-JPEG path, the UNet-size round trip, and its one-line errors. The sampler's maths: tests/test_diffusion.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.methods import dda
from tiny import TINY, StandInUNet, StandInUNetConfig, batches, tiny_model

META = {"kind": "unet", "diffusion": {"diffusion_steps": 1000, "noise_schedule": "linear", "learn_sigma": True}}


def standin(size: int = 32, seed: int = 0):
  unet = StandInUNet(StandInUNetConfig(image_size=size))
  x = jnp.zeros((1, size, size, 3))
  return unet, jax.device_get(unet.init(jax.random.key(seed), x, jnp.zeros((1,), jnp.int32))["params"])


@dataclasses.dataclass(frozen=True)
class StandInDDA(dda.DDA):
  """DDA with `tiny.StandInUNet` for the UNet: `prepare` hands it to `DDA.prepare_with` instead of loading a
  checkpoint; everything else is DDA's."""

  def check_inputs(self, model, params, batch_size) -> None:
    pass

  def prepare(self, model, params, rng, batch_size):
    unet, unet_params = standin()
    return self.prepare_with(model, params, unet, unet_params, META)


def run(method, xs, seed=0, batch_size=4):
  model, params = tiny_model()
  ad = engine.Adapter(method, model, params, batch_size=batch_size, seed=seed)
  state, out = ad.init_state(), []
  for x in xs:
    state, logits, metrics = ad.step(state, x)
    out.append(np.asarray(logits)[: len(x)])
  return out, metrics


def test_dda_through_the_engine_reports_the_official_ensemble():
  """With the JPEG round trip (a host callback inside the engine's jitted step) and a ragged last batch: the
  softmax of what DDA reports is the mean of the source model's softmax on the input and another distribution
  (the projection's; `ensemble` itself: test_ensemble_modes_as_the_official); a seed gives the same numbers."""
  xs = batches(2, 4, last=3)  # one padding row in the last batch
  kw = dict(N=3, group=2)
  both, metrics = run(StandInDDA(**kw), xs)
  source, _ = run(methods.get("source"), xs)
  for b, s in zip(both, source):
    assert np.isfinite(b).all() and b.shape == (len(s), TINY.num_classes)
    generated = 2 * np.exp(b) - np.asarray(jax.nn.softmax(s))
    assert generated.min() > -1e-6 and np.allclose(generated.sum(1), 1, atol=1e-5)
    assert np.abs(generated - np.asarray(jax.nn.softmax(s))).max() > 1e-3  # the projection moved the prediction
  assert 0 <= float(metrics["agreement"]) <= 1
  again, _ = run(StandInDDA(**kw), xs)
  for a, b in zip(again, both):
    np.testing.assert_array_equal(a, b)  # deterministic for a seed (another key: tests/test_diffusion.py)


def test_only_the_before_order_is_offered():
  model, params = tiny_model()
  with pytest.raises(UserError, match="^eval_order: expected before for dda"):
    engine.Adapter(StandInDDA(N=2), model, params, batch_size=2, eval_order="after")


def _official_ensemble(p1: np.ndarray, p2: np.ndarray, mode: str) -> np.ndarray:
  """``model_adapt/evaluation.py``'s ``select_logits_to_idx`` / ``ensemble_from_logits`` on the classifier's
  softmax outputs, in numpy."""
  softmax = lambda z: np.exp(z - z.max(1, keepdims=True)) / np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)
  ent = lambda p: -(softmax(p) * np.log(softmax(p))).sum(1, keepdims=True)
  con = lambda p: softmax(p).max(1, keepdims=True)
  select = lambda idx: p1 * ~idx + p2 * idx
  return {"sum": lambda: p1 + p2, "first": lambda: p1, "second": lambda: p2,
          "entropy": lambda: select(ent(p1) >= ent(p2)), "confidence": lambda: select(con(p1) <= con(p2)),
          "var": lambda: select(p1.var(1, ddof=1, keepdims=True) <= p2.var(1, ddof=1, keepdims=True)),
          "entropy_sum": lambda: p1 * ent(p2) + p2 * ent(p1),
          "confidence_sum": lambda: p1 * con(p1) + p2 * con(p2)}[mode]()


@pytest.mark.parametrize("mode", dda.ENSEMBLES)
def test_ensemble_modes_as_the_official(mode):
  rng = np.random.default_rng(0)
  l1, l2 = rng.standard_normal((2, 64, 10)) * 3
  p1, p2 = np.asarray(jax.nn.softmax(l1)), np.asarray(jax.nn.softmax(l2))
  want = _official_ensemble(p1, p2, mode)
  got = np.asarray(dda.ensemble(jnp.asarray(l1), jnp.asarray(l2), mode))
  np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
  np.testing.assert_allclose(np.exp(got), want / want.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
  if mode in ("entropy", "confidence", "var"):  # a selection: it picks each branch somewhere
    assert np.isclose(np.exp(got), p1, atol=1e-6).all(1).sum() not in (0, 64)


@pytest.mark.torch
def test_the_jpeg_round_trip_is_save_image_and_pil(tmp_path):
  """What the classifier reads equals ``torchvision.utils.save_image(normalize=True, range (-1, 1))`` of the
  projection to a ``.JPEG`` file, read back by PIL."""
  import torch
  from PIL import Image
  from torchvision.utils import save_image

  x = np.random.default_rng(1).uniform(-1.3, 1.3, (2, 16, 16, 3)).astype(np.float32)
  for codec in ("pil", "device"):  # the device's jitted libjpeg (a GPU's or TPU's step) to the bit, too
    got = np.asarray(jax.jit(lambda a: dda.jpeg_round_trip(dda.to_uint8(a), 75, codec))(x))
    for i in range(2):
      path = str(tmp_path / f"{i}.JPEG")
      save_image(torch.from_numpy(x[i]).permute(2, 0, 1)[None], path, normalize=True, value_range=(-1, 1))
      np.testing.assert_array_equal(got[i], np.asarray(Image.open(path).convert("RGB")), err_msg=codec)


def test_the_accelerator_form_runs_the_groups_together_with_the_cpu_forms_numbers():
  """Built for a GPU (run here on the CPU): the groups together (vmap), the device JPEG, XLA's attention and
  backward passes; the logits are the CPU form's (groups one after the other, PIL, the closed forms) within
  float32 rounding (3.6e-6 seen; 1e-4 allowed), so each group keeps its own guidance norm when vmapped."""
  xs = batches(2, 4, last=3)
  model, params = tiny_model()
  out = {}
  for platform in ("cpu", "gpu"):
    ad = engine.Adapter(StandInDDA(N=3, group=2), model, params, batch_size=4, platform=platform)
    state, logits = ad.init_state(), []
    for x in xs:
      state, lg, _ = ad.step(state, x)
      logits.append(np.asarray(lg))
    out[platform] = logits
  assert engine.Adapter(StandInDDA(N=3), model, params, batch_size=4, platform="gpu").prep.platform == "gpu"
  for a, b in zip(out["gpu"], out["cpu"]):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_unet_size_round_trip_and_no_jpeg():
  """The classifier's 32 px images go to a 64 px UNet and back: a uniform image stays uniform (its value in
  [-1, 1] there), and without the JPEG the float projection comes back unquantised."""
  model, params = tiny_model()
  m = dda.DDA(jpeg_quality=0, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
  unet, unet_params = standin(64)
  prep = m.prepare_with(model, params, unet, unet_params, META)
  x01 = jnp.broadcast_to(jnp.array([0.2, 0.5, 0.9]), (2, 32, 32, 3))
  images = (x01 - jnp.array(m.mean)) / jnp.array(m.std)
  y = m.to_unet(prep, images)
  assert y.shape == (2, 64, 64, 3)
  np.testing.assert_allclose(y, jnp.broadcast_to(jnp.array([-0.6, 0.0, 0.8]), y.shape), atol=1e-5)
  back = m.from_unet(prep, y + 1e-3, (32, 32))
  np.testing.assert_allclose(back, images + 1e-3 / 2 / jnp.array(m.std), atol=1e-5)


def test_dda_errors_are_one_line(tmp_path):
  from harness_fixtures import make_checkpoint

  cases = [(dict(D=3), r"^dda D: expected a power of 2"), (dict(respacing="abc"), r"^dda respacing: expected"),
           (dict(N=0), r"^dda N: expected an integer >= 1"), (dict(ensemble="mean"), r"^dda ensemble: expected one of"),
           (dict(guidance="pixel"), r"^dda guidance: expected one of")]
  for kw, match in cases:
    with pytest.raises(UserError, match=match) as e:
      methods.get("dda", **kw)
    assert "\n" not in str(e.value)
  model, params = tiny_model()
  unet, unet_params = standin()
  with pytest.raises(UserError, match=r"^dda N: expected below the respaced step count 100"):
    dda.DDA(N=100).prepare_with(model, params, unet, unet_params, META)
  with pytest.raises(UserError, match=r"^dda respacing 'ddim999': no integer stride"):
    dda.DDA(respacing="ddim999").prepare_with(model, params, unet, unet_params, META)
  with pytest.raises(UserError, match=r"^dda unet: needs a diffusion checkpoint; convert OpenAI"):
    methods.get("dda").check_inputs(model, params, 4)
  with pytest.raises(UserError, match=r"^dda unet: .*not a pcsr-jax checkpoint"):
    methods.get("dda", unet=str(tmp_path / "nowhere")).check_inputs(model, params, 4)
  vit = make_checkpoint(str(tmp_path / "vit"))
  with pytest.raises(UserError, match=r"^dda unet .*vit: a classifier checkpoint .*, not a diffusion model"):
    methods.get("dda", unet=vit).check_inputs(model, params, 4)


def test_dda_inputs_are_checked_before_the_first_method_runs(tmp_path, capsys):
  """A UNet that does not fit (D above its image size), a class-conditional one and one with damaged params are
  each refused in one line once the checkpoint is loaded: Source, listed first, never ran (they were found only
  when DDA came up, after Source's work)."""
  import glob
  import json
  import shutil

  from pcsr_jax import checkpoint
  from pcsr_jax.experiments import imagenet_c
  from pcsr_jax.models.unet import UNet, UNetConfig
  from tiny import dda_unet

  good = dda_unet(str(tmp_path / "unet"))
  cond = UNetConfig(image_size=32, num_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(16,),
                    out_channels=6, num_head_channels=16, class_cond=True)
  x, t = jnp.zeros((1, 32, 32, 3)), jnp.zeros((1,), jnp.int32)
  cond_params = jax.device_get(UNet(cond).init(jax.random.key(0), x, t, jnp.zeros((1,), jnp.int32))["params"])
  class_cond = checkpoint.save(str(tmp_path / "cond"), cond_params, checkpoint.make_unet_meta(
      cond, dict(diffusion_steps=1000, noise_schedule="linear", learn_sigma=True)))
  damaged = str(tmp_path / "damaged")
  shutil.copytree(good, damaged)
  for p in glob.glob(f"{damaged}/params/**/d/*", recursive=True):
    with open(p, "r+b") as f:
      f.truncate(10)
  for k, (args, match) in enumerate((
      ({"unet": good, "D": 64, "respacing": "ddim4", "N": 2}, r"^dda D: expected at most the UNet's image size 32"),
      ({"unet": class_cond, "respacing": "ddim4", "N": 2}, r"^dda unet .*cond: a class-conditional model"),
      ({"unet": damaged, "respacing": "ddim4", "N": 2}, r"^dda unet: .*checkpoint params unreadable"))):
    out = tmp_path / f"o{k}"
    with pytest.raises(UserError, match=match) as e:
      imagenet_c.main(["--methods", "source,dda", "--images", "8", "--corruptions", "fog", "--batch-size", "4",
                       "--no-progress", "--output", str(out), "--method-args", json.dumps({"dda": args})])
    assert "\n" not in str(e.value)
    printed = capsys.readouterr().out
    assert "source/seed2022" not in printed and not (out / "results.json").exists(), printed


# ---------------------------------------------------------------- with guided-diffusion's UNet (pcsr_jax.models.unet)

@pytest.mark.slow
@pytest.mark.torch
def test_guided_steps_with_the_unet_agree_with_the_reference():
  """DDA's sampler with guided-diffusion's UNet (random weights everywhere, its zeroed output convs too) in both
  frameworks, the same images and draws: 5 free-running guided steps from index 5, within 1e-4 absolute (7.7e-7
  seen; 4.5e-6 after 20 steps: this UNet does not amplify rounding as the random stand-in of
  tests/test_diffusion.py does). Each UNet forward and input gradient agrees to ~5e-6 relative
  (tests/test_unet.py); the sampler's own rounding is ~1e-6 per step."""
  pytest.importorskip("pcsr_jax.models.unet")
  from benchmarks.torch_methods import dda as ref
  from benchmarks.torch_methods import guided_unet
  from pcsr_jax import diffusion
  from pcsr_jax.models.unet import UNet, UNetConfig
  from pcsr_jax.weights import guided_diffusion as gd

  cfg = UNetConfig(image_size=32, num_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(16,),
                   out_channels=6, num_head_channels=16, resblock_updown=True, use_scale_shift_norm=True)
  model = guided_unet.randomize_(guided_unet.build(cfg), 0).eval()
  params = gd.torch_to_flax({k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, cfg)
  s = diffusion.make_schedule(1000, "linear", "100")
  y = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  key, N = jax.random.key(3), 5
  model_fn = lambda x, t: UNet(cfg).apply({"params": params}, x, t)
  got = jax.jit(lambda yy, k: diffusion.guided_sample(s, model_fn, yy, k, N=N, D=4, scale=6.0))(y, key)
  to_t = lambda a: __import__("torch").from_numpy(np.array(a)).permute(0, 3, 1, 2)
  want = ref.guided_sample(ref.SpacedDiffusion(1000, "100"), lambda x, t: model(x, t), to_t(y),
                           [to_t(n) for n in diffusion.sampler_noise(key, y.shape, N)], N, 4, 6.0)
  want = want.permute(0, 2, 3, 1).numpy()
  assert np.abs(want - y).max() > 0.1
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_dda_through_the_harness_with_a_diffusion_checkpoint(tmp_path):
  """`dda` from the harness's config, as the CLI runs it: a tiny ViT checkpoint and a tiny diffusion checkpoint
  (tests/tiny.py's, written with `checkpoint.save`) on generated ImageNet-C folders; the records and, with an
  unusable ``unet``, the one-line error before any work."""
  pytest.importorskip("pcsr_jax.models.unet")
  import harness_fixtures as hf
  from pcsr_jax import harness
  from tiny import dda_unet

  world = hf.make_world(tmp_path / "w", ("fog",), classes=2, per_class=3)
  unet = dda_unet(str(tmp_path / "unet"))
  cfg = lambda out, **args: harness.RunConfig(
      data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(tmp_path / out), corruptions=("fog",),
      seeds=(1,), batch_size=4, progress=False, methods=("dda",), method_args={"dda": {"unet": unet, "N": 2, **args}})
  res = harness.run(cfg("out"), log=lambda *a: None)
  (rec,) = res["records"]
  assert rec["method"] == "dda" and rec["num_samples"] == 6 and 0 <= rec["accuracy"] <= 1
  with pytest.raises(UserError, match=r"^dda N: expected below the respaced step count 10 "):
    harness.run(cfg("bad", respacing="10", N=10), log=lambda *a: None)
  with pytest.raises(UserError, match=r"^dda unet .*: a classifier checkpoint"):
    harness.run(harness.RunConfig(**{**dataclasses.asdict(cfg("vit")), "method_args": {"dda": {"unet": str(
        world / "ckpt")}}}), log=lambda *a: None)
