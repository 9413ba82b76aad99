"""guided-diffusion UNet checkpoints (OpenAI's ``*.pt``) <-> the Flax params of `pcsr_jax.models.unet`.

The config comes from guided-diffusion's own flags (``script_util.model_and_diffusion_defaults()`` keys, as
JSON) or from the name of a published checkpoint (`PUBLISHED`, the flags of guided-diffusion's README). The
names map by one rule: torch's module indices become ``_``-joined parts of the Flax module name
(``input_blocks.3.0.in_layers.2.weight`` <-> ``input_blocks_3_0/in_layers_2/kernel``), and per kind of layer:

==================================  ==========================================
torch                               Flax
==================================  ==========================================
Conv2d weight [O, I, kh, kw]        kernel [kh, kw, I, O]
Linear weight [O, I]                kernel [I, O]
Conv1d (qkv, proj_out) [O, I, 1]    kernel [I, O] (a Dense on the channels)
GroupNorm weight / bias             scale / bias
Embedding weight [N, D]             embedding [N, D]
==================================  ==========================================

What the shapes fix is checked against the config before the generic key and shape checks, each naming the
flag: num_channels, in/out channels (learn_sigma), class_cond, the number of blocks (num_res_blocks and the
levels of channel_mult), resblock_updown, channel_mult, use_scale_shift_norm and attention_resolutions. The
heads are not in the shapes (qkv is [3C, C, 1] for any head count); `UNetConfig` checks that they divide every
attention width.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import numpy as np
from flax import traverse_util

from pcsr_jax.errors import UserError
from pcsr_jax.models.unet import UNetConfig, param_shapes, plan

StateDict = dict[str, np.ndarray]

# script_util.model_and_diffusion_defaults(): the model keys, then diffusion_defaults().
MODEL_DEFAULTS: dict[str, Any] = dict(
    image_size=64, num_channels=128, num_res_blocks=2, num_heads=4, num_heads_upsample=-1, num_head_channels=-1,
    attention_resolutions="16,8", channel_mult="", dropout=0.0, class_cond=False, use_checkpoint=False,
    use_scale_shift_norm=True, resblock_updown=False, use_fp16=False, use_new_attention_order=False)
DIFFUSION_DEFAULTS: dict[str, Any] = dict(
    learn_sigma=False, diffusion_steps=1000, noise_schedule="linear", timestep_respacing="", use_kl=False,
    predict_xstart=False, rescale_timesteps=False, rescale_learned_sigmas=False)
DEFAULTS = {**MODEL_DEFAULTS, **DIFFUSION_DEFAULTS}

_COMMON = dict(attention_resolutions="32,16,8", diffusion_steps=1000, learn_sigma=True, noise_schedule="linear",
               num_channels=256, num_head_channels=64, num_res_blocks=2, resblock_updown=True, use_fp16=True,
               use_scale_shift_norm=True)
_LSUN = dict(_COMMON, class_cond=False, dropout=0.1, image_size=256)
# MODEL_FLAGS of guided-diffusion's README, per released checkpoint
# (https://openaipublic.blob.core.windows.net/diffusion/jul-2021/<name>.pt).
PUBLISHED: dict[str, dict[str, Any]] = {
    "64x64_diffusion": dict(_COMMON, class_cond=True, dropout=0.1, image_size=64, noise_schedule="cosine",
                            num_channels=192, num_res_blocks=3, use_new_attention_order=True),
    "128x128_diffusion": dict(_COMMON, class_cond=True, image_size=128, num_head_channels=-1, num_heads=4),
    "256x256_diffusion": dict(_COMMON, class_cond=True, image_size=256),
    "256x256_diffusion_uncond": dict(_COMMON, class_cond=False, image_size=256),
    "512x512_diffusion": dict(_COMMON, class_cond=True, image_size=512, use_fp16=False),
    "lsun_bedroom": _LSUN, "lsun_cat": _LSUN, "lsun_horse": _LSUN,
    "lsun_horse_nodropout": dict(_LSUN, dropout=0.0),
}
NOISE_SCHEDULES = ("linear", "cosine")  # gaussian_diffusion.get_named_beta_schedule


def read_flags(spec: str) -> tuple[dict[str, Any], str]:
  """``--unet-config``: a published checkpoint's name, a JSON file or an inline JSON object -> the full flag
  dict (defaults filled in) and a name for messages. Unknown keys and ill-typed values are refused."""
  where = f"--unet-config {spec}"
  if spec in PUBLISHED:
    given = dict(PUBLISHED[spec])
  else:
    if spec.lstrip().startswith("{"):
      text, where = spec, "--unet-config"
    elif os.path.isfile(spec):
      with open(spec, encoding="utf-8") as f:
        text = f.read()
    else:
      raise UserError(f"{where}: not a JSON file, a JSON object or a published checkpoint name "
                      f"({', '.join(PUBLISHED)})")
    try:
      given = json.loads(text)
    except ValueError as e:
      raise UserError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(given, dict):
      raise UserError(f"{where}: expected a JSON object of guided-diffusion flags, got {type(given).__name__}")
  unknown = sorted(set(given) - set(DEFAULTS))
  if unknown:
    raise UserError(f"{where}: unknown keys {unknown} (expected guided-diffusion's model_and_diffusion_defaults() "
                    f"keys: {', '.join(DEFAULTS)})")
  flags = {**DEFAULTS, **given}
  for k, default in DEFAULTS.items():
    v = flags[k]
    if k in ("attention_resolutions", "channel_mult"):
      ok = isinstance(v, str) or (isinstance(v, list) and all(
          isinstance(a, (int, float)) and not isinstance(a, bool) for a in v))
      expected = "a comma-separated string or a list of numbers"
    elif isinstance(default, bool):
      ok, expected = isinstance(v, bool), "true or false"
    elif isinstance(default, int):
      ok, expected = isinstance(v, int) and not isinstance(v, bool), "an integer"
    elif isinstance(default, float):
      ok, expected = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
    else:
      ok, expected = isinstance(v, str), "a string"
    if not ok:
      raise UserError(f"{where}: {k} must be {expected}, got {v!r}")
  if flags["noise_schedule"] not in NOISE_SCHEDULES:
    raise UserError(f"{where}: noise_schedule must be one of {list(NOISE_SCHEDULES)}, got {flags['noise_schedule']!r}")
  if flags["diffusion_steps"] < 1:
    raise UserError(f"{where}: diffusion_steps must be positive, got {flags['diffusion_steps']}")
  return flags, where


def _numbers(v: Any, k: str, where: str, cast: type) -> tuple:
  if isinstance(v, list):
    return tuple(cast(a) for a in v)
  try:
    return tuple(cast(a) for a in v.split(",")) if v.strip() else ()
  except ValueError:
    raise UserError(f"{where}: {k} must be comma-separated numbers, got {v!r}") from None


def config_from_flags(flags: Mapping[str, Any], where: str = "--unet-config") -> tuple[UNetConfig, dict[str, Any]]:
  """guided-diffusion's flags -> the `UNetConfig` ``create_model`` builds, and the diffusion settings
  (``diffusion_defaults()`` keys) a checkpoint records. ``use_fp16`` is recorded only: the checkpoint is
  float32 and the compute dtype is chosen when the model is built."""
  attn = _numbers(flags["attention_resolutions"], "attention_resolutions", where, int)
  mult = _numbers(flags["channel_mult"], "channel_mult", where, float)
  try:
    cfg = UNetConfig(
        image_size=flags["image_size"], in_channels=3, num_channels=flags["num_channels"],
        out_channels=6 if flags["learn_sigma"] else 3, num_res_blocks=flags["num_res_blocks"],
        attention_resolutions=attn, channel_mult=mult, num_heads=flags["num_heads"],
        num_head_channels=flags["num_head_channels"], num_heads_upsample=flags["num_heads_upsample"],
        use_scale_shift_norm=flags["use_scale_shift_norm"], resblock_updown=flags["resblock_updown"],
        use_new_attention_order=flags["use_new_attention_order"], class_cond=flags["class_cond"],
        dropout=float(flags["dropout"]), use_checkpoint=flags["use_checkpoint"])
  except UserError as e:
    raise UserError(f"{where}: {e}") from None
  return cfg, {k: flags[k] for k in DIFFUSION_DEFAULTS} | {"use_fp16": flags["use_fp16"]}


def torch_key(path: tuple[str, ...]) -> str:
  """``('input_blocks_3_0', 'in_layers_2', 'kernel')`` -> ``'input_blocks.3.0.in_layers.2.weight'``."""
  *mods, leaf = path
  parts = [re.sub(r"_(\d+)", r".\1", m) for m in mods]
  return ".".join(parts + ["bias" if leaf == "bias" else "weight"])


def _is_conv1d(path: tuple[str, ...]) -> bool:
  return path[-2] in ("qkv", "proj_out")


def _to_torch(path: tuple[str, ...], a: np.ndarray) -> np.ndarray:
  if path[-1] != "kernel":
    return a
  if a.ndim == 4:
    return a.transpose(3, 2, 0, 1)
  return a.T[:, :, None] if _is_conv1d(path) else a.T


def _from_torch(path: tuple[str, ...], w: np.ndarray) -> np.ndarray:
  if path[-1] != "kernel":
    return w
  if w.ndim == 4:
    return w.transpose(2, 3, 1, 0)
  return w[:, :, 0].T if _is_conv1d(path) else w.T


def _torch_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  """`_to_torch` on shapes."""
  if path[-1] != "kernel":
    return tuple(shape)
  if len(shape) == 4:
    kh, kw, i, o = shape
    return (o, i, kh, kw)
  i, o = shape
  return (o, i, 1) if _is_conv1d(path) else (o, i)


def expected_shapes(cfg: UNetConfig) -> dict[str, tuple[int, ...]]:
  """Every key and shape of the official state dict for ``cfg``."""
  return {torch_key(path): _torch_shape(path, s.shape)
          for path, s in traverse_util.flatten_dict(param_shapes(cfg)).items()}


def _diagnose(sd: Mapping[str, np.ndarray], cfg: UNetConfig, where: str) -> None:
  """Raises naming the flag when the state dict's shapes contradict one that they fix."""
  shape = lambda k: tuple(np.shape(sd[k])) if k in sd else None
  fail = lambda msg: UserError(f"{where}: {msg}")
  s = shape("time_embed.0.weight")
  if s is None or len(s) != 2:
    raise fail(f"time_embed.0.weight is {'missing' if s is None else s}: not a guided-diffusion UNet state dict")
  if s[1] != cfg.num_channels:
    raise fail(f"num_channels {cfg.num_channels} does not fit the checkpoint: time_embed.0.weight {s} "
               f"is num_channels {s[1]}")
  s = shape("out.2.weight")
  if s is not None and s[0] != cfg.out_channels:
    raise fail(f"learn_sigma {cfg.out_channels == 2 * cfg.in_channels} does not fit the checkpoint: out.2.weight "
               f"{s} has {s[0]} output channels, the config {cfg.out_channels}")
  s = shape("input_blocks.0.0.weight")
  if s is not None and len(s) == 4 and s[0] != cfg.widths[0]:
    raise fail(f"channel_mult {list(cfg.channel_mult)} does not fit the checkpoint: input_blocks.0.0.weight {s} "
               f"has {s[0]} channels, the config {cfg.widths[0]}")
  if ("label_emb.weight" in sd) != cfg.class_cond:
    raise fail(f"class_cond {cfg.class_cond} does not fit the checkpoint: it "
               f"{'has' if 'label_emb.weight' in sd else 'lacks'} label_emb.weight")
  p = plan(cfg)
  n_in = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"input_blocks\.(\d+)\.", k))), default=-1)
  if n_in != len(p.input_blocks):
    raise fail(f"num_res_blocks {cfg.num_res_blocks} x {len(cfg.channel_mult)} levels (channel_mult "
               f"{list(cfg.channel_mult)}) make {len(p.input_blocks)} input blocks, the checkpoint has {n_in}")
  for i, block in enumerate(p.input_blocks):
    first, pre = block.layers[0], f"input_blocks.{i}.0."
    if first.kind == "down" and f"{pre}op.weight" not in sd and f"{pre}in_layers.0.weight" in sd:
      raise fail(f"resblock_updown false does not fit the checkpoint: {pre}in_layers.0.weight is a ResBlock "
                 f"where the config has a strided conv ({pre}op.weight)")
    if first.updown == "down" and f"{pre}op.weight" in sd:
      raise fail(f"resblock_updown true does not fit the checkpoint: {pre}op.weight is a strided conv where the "
                 f"config has a ResBlock")
    s = shape(f"{pre}out_layers.3.weight")
    if first.kind == "res" and s is not None and s[0] != first.out:
      raise fail(f"channel_mult {list(cfg.channel_mult)} does not fit the checkpoint: {pre}out_layers.3.weight "
                 f"{s} has {s[0]} channels, the config {first.out}")
    s = shape(f"{pre}emb_layers.1.weight")
    if first.kind == "res" and s is not None and s[0] != first.out * (2 if cfg.use_scale_shift_norm else 1):
      raise fail(f"use_scale_shift_norm {cfg.use_scale_shift_norm} does not fit the checkpoint: "
                 f"{pre}emb_layers.1.weight {s} gives {s[0]} values for {first.out} channels")
  got = sorted({b.px for i, b in enumerate(p.input_blocks) if f"input_blocks.{i}.1.qkv.weight" in sd})
  want = sorted({b.px for b in p.input_blocks if any(l.kind == "attn" for l in b.layers)})
  if got != want:
    raise fail(f"attention_resolutions {list(cfg.attention_resolutions)} does not fit the checkpoint: its "
               f"input blocks have attention at {got} px, the config's at {want} px")


def check_state_dict(sd: Mapping[str, np.ndarray], cfg: UNetConfig, src: str = "checkpoint") -> None:
  """Raises a one-line `UserError`: first a flag the shapes contradict, then missing / unexpected keys, a bad
  shape, or NaN / inf."""
  _diagnose(sd, cfg, src)
  exp = expected_shapes(cfg)
  missing, unexpected = sorted(set(exp) - set(sd)), sorted(set(sd) - set(exp))
  if missing or unexpected:
    few = lambda ks: ks[:5] + (["..."] if len(ks) > 5 else [])
    parts = [f"missing keys {few(missing)}" if missing else "",
             f"unexpected keys {few(unexpected)}" if unexpected else ""]
    raise UserError(f"{src}: state dict does not match the UNet config ({len(missing)} missing, {len(unexpected)} "
                    f"unexpected): " + "; ".join(p for p in parts if p))
  for k, s in exp.items():
    if tuple(np.shape(sd[k])) != s:
      raise UserError(f"{src}: shape mismatch for '{k}': checkpoint {tuple(np.shape(sd[k]))}, the UNet config "
                      f"expects {s}")
  bad = [k for k in exp if not np.isfinite(sd[k]).all()]
  if bad:
    raise UserError(f"{src}: {len(bad)} tensors hold NaN or inf (e.g. '{bad[0]}')")


def torch_to_flax(sd: Mapping[str, np.ndarray], cfg: UNetConfig, src: str = "checkpoint") -> dict:
  """A checked guided-diffusion state dict -> the params tree of ``UNet(cfg)`` (float32)."""
  check_state_dict(sd, cfg, src)
  flat = {path: np.asarray(_from_torch(path, np.asarray(sd[torch_key(path)], np.float32)), np.float32)
          for path in traverse_util.flatten_dict(param_shapes(cfg))}
  return traverse_util.unflatten_dict(flat)


def flax_to_torch(params: Mapping[str, Any]) -> StateDict:
  """The inverse of `torch_to_flax`."""
  return {torch_key(path): np.ascontiguousarray(_to_torch(path, np.asarray(v, np.float32)))
          for path, v in traverse_util.flatten_dict(params).items()}
