"""The one-to-one map between a timm ViT state dict and the Flax params (`pcsr_jax.models.vit`).

==================================  ===========================================
timm                                Flax
==================================  ===========================================
patch_embed.proj.weight [D,C,p,p]   patch_embed/proj/kernel [p,p,C,D]
cls_token, pos_embed                cls_token, pos_embed (same shape)
blocks.i.norm1.weight / .bias       blocks_i/norm1/scale / bias
blocks.i.attn.qkv.weight [3D,D]     blocks_i/attn/qkv/kernel [D,3D]
blocks.i.<lin>.weight [out,in]      blocks_i/<lin>/kernel [in,out]
norm.weight, head.weight            norm/scale, head/kernel
==================================  ===========================================

Also: the `ViTConfig` a state dict implies, the key and shape checks, and the
preprocessing metadata a converted checkpoint carries.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import numpy as np

from pcsr_jax.errors import UserError
from pcsr_jax.models import configs
from pcsr_jax.models.configs import ViTConfig

StateDict = dict[str, np.ndarray]

_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
_NORMS = ("norm1", "norm2")


def num_blocks(sd: Mapping[str, Any]) -> int:
  idx = [int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))]
  return max(idx) + 1 if idx else 0


def infer_config(sd: Mapping[str, np.ndarray], src: str = "checkpoint", arch: str | None = None,
                 num_classes: int | None = None) -> ViTConfig:
  """The `ViTConfig` of a timm state dict, from ``arch`` or else from its shapes."""
  for k in ("patch_embed.proj.weight", "pos_embed", "cls_token"):
    if k not in sd:
      raise UserError(f"{src}: missing key '{k}': not a timm VisionTransformer state dict")
  for k, rank in (("patch_embed.proj.weight", 4), ("pos_embed", 3), ("cls_token", 3)):
    if np.ndim(sd[k]) != rank:
      raise UserError(f"{src}: '{k}' has shape {tuple(np.shape(sd[k]))}, expected rank {rank}")
  w = sd["patch_embed.proj.weight"]
  d, in_chans, patch = w.shape[0], w.shape[1], w.shape[2]
  n = sd["pos_embed"].shape[1] - 1
  img = int(round(n ** 0.5)) * patch
  head_classes = sd["head.weight"].shape[0] if "head.weight" in sd else 0
  if num_classes is not None and num_classes != head_classes:
    raise UserError(f"{src}: --num-classes {num_classes} but the checkpoint's head has {head_classes} classes "
                    f"(head.weight {tuple(sd['head.weight'].shape) if 'head.weight' in sd else None})")
  if arch is not None:
    return configs.get_config(arch, num_classes=head_classes)
  depth = num_blocks(sd)
  heads = configs.heads_for_width(d)
  if heads is None:
    raise UserError(f"{src}: embed dim {d} is not a standard timm width; pass --arch")
  mlp_ratio = sd["blocks.0.mlp.fc1.weight"].shape[0] / d if "blocks.0.mlp.fc1.weight" in sd else 4.0
  name = (configs.arch_name(d, depth, patch, img) if mlp_ratio == 4.0 else None) or "custom"
  return ViTConfig(embed_dim=d, depth=depth, num_heads=heads, patch_size=patch, img_size=img,
                   num_classes=head_classes, mlp_ratio=mlp_ratio, in_chans=in_chans, name=name)


def expected_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
  """Every key and shape of timm's state dict for ``cfg``."""
  d, m = cfg.embed_dim, cfg.mlp_dim
  s = {
      "patch_embed.proj.weight": (d, cfg.in_chans, cfg.patch_size, cfg.patch_size),
      "patch_embed.proj.bias": (d,),
      "cls_token": (1, 1, d),
      "pos_embed": (1, cfg.num_patches + 1, d),
      "norm.weight": (d,), "norm.bias": (d,),
  }
  if cfg.num_classes > 0:
    s["head.weight"], s["head.bias"] = (cfg.num_classes, d), (cfg.num_classes,)
  lin = {"attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.fc1": (m, d), "mlp.fc2": (d, m)}
  for i in range(cfg.depth):
    for n in _NORMS:
      s[f"blocks.{i}.{n}.weight"] = s[f"blocks.{i}.{n}.bias"] = (d,)
    for n, shape in lin.items():
      s[f"blocks.{i}.{n}.weight"], s[f"blocks.{i}.{n}.bias"] = shape, (shape[0],)
  return s


def check_state_dict(sd: Mapping[str, np.ndarray], cfg: ViTConfig, src: str = "checkpoint") -> None:
  """Raises a `UserError` listing missing / unexpected keys or naming a bad shape."""
  check_against(sd, expected_shapes(cfg), src, cfg.name)


def check_against(sd: Mapping[str, np.ndarray], exp: Mapping[str, tuple[int, ...]], src: str, model: str) -> None:
  """A state dict against the shapes a model expects (``model`` names it in the message): missing or unexpected
  keys (the first five of each), then a bad shape, then NaN / inf, each as a one-line `UserError`. Shared by
  every converter (ViTs here, guided-diffusion's UNet in `pcsr_jax.weights.guided_diffusion`)."""
  missing, unexpected = sorted(set(exp) - set(sd)), sorted(set(sd) - set(exp))
  if missing or unexpected:
    few = lambda ks: ks[:5] + (["..."] if len(ks) > 5 else [])
    parts = [f"missing keys {few(missing)}" if missing else "",
             f"unexpected keys {few(unexpected)}" if unexpected else ""]
    raise UserError(f"{src}: state dict does not match {model} ({len(missing)} missing, {len(unexpected)} "
                    f"unexpected): " + "; ".join(p for p in parts if p))
  for k, shape in exp.items():
    if tuple(np.shape(sd[k])) != tuple(shape):
      raise UserError(f"{src}: shape mismatch for '{k}': checkpoint {tuple(np.shape(sd[k]))}, {model} expects "
                      f"{tuple(shape)}")
  bad = [k for k in exp if not np.isfinite(sd[k]).all()]
  if bad:
    raise UserError(f"{src}: {len(bad)} tensors hold NaN or inf (e.g. '{bad[0]}')")


def timm_to_flax(sd: Mapping[str, np.ndarray], cfg: ViTConfig, src: str = "checkpoint") -> dict:
  """A checked timm state dict -> the Flax params tree of `VisionTransformer`."""
  check_state_dict(sd, cfg, src)
  f32 = lambda a: np.asarray(a, np.float32)
  params: dict[str, Any] = {
      "patch_embed": {"proj": {"kernel": f32(sd["patch_embed.proj.weight"]).transpose(2, 3, 1, 0),
                               "bias": f32(sd["patch_embed.proj.bias"])}},
      "cls_token": f32(sd["cls_token"]),
      "pos_embed": f32(sd["pos_embed"]),
      "norm": {"scale": f32(sd["norm.weight"]), "bias": f32(sd["norm.bias"])},
  }
  if cfg.num_classes > 0:
    params["head"] = {"kernel": f32(sd["head.weight"]).T, "bias": f32(sd["head.bias"])}
  for i in range(cfg.depth):
    t, blk = f"blocks.{i}.", {}
    for n in _NORMS:
      blk[n] = {"scale": f32(sd[t + n + ".weight"]), "bias": f32(sd[t + n + ".bias"])}
    for n in _LINEARS:
      mod, sub = n.split(".")
      blk.setdefault(mod, {})[sub] = {"kernel": f32(sd[t + n + ".weight"]).T, "bias": f32(sd[t + n + ".bias"])}
    params[f"blocks_{i}"] = blk
  return params


def flax_to_timm(params: Mapping[str, Any]) -> StateDict:
  """The inverse of `timm_to_flax` (backbone keys only; recalibrator params are dropped)."""
  a = lambda x: np.asarray(x, np.float32)
  sd = {
      "patch_embed.proj.weight": a(params["patch_embed"]["proj"]["kernel"]).transpose(3, 2, 0, 1),
      "patch_embed.proj.bias": a(params["patch_embed"]["proj"]["bias"]),
      "cls_token": a(params["cls_token"]),
      "pos_embed": a(params["pos_embed"]),
      "norm.weight": a(params["norm"]["scale"]), "norm.bias": a(params["norm"]["bias"]),
  }
  if "head" in params:
    sd["head.weight"], sd["head.bias"] = a(params["head"]["kernel"]).T, a(params["head"]["bias"])
  blocks = sorted((int(k.split("_")[1]) for k in params if re.fullmatch(r"blocks_\d+", k)))
  for i in blocks:
    blk, t = params[f"blocks_{i}"], f"blocks.{i}."
    for n in _NORMS:
      sd[t + n + ".weight"], sd[t + n + ".bias"] = a(blk[n]["scale"]), a(blk[n]["bias"])
    for n in _LINEARS:
      mod, sub = n.split(".")
      sd[t + n + ".weight"], sd[t + n + ".bias"] = a(blk[mod][sub]["kernel"]).T, a(blk[mod][sub]["bias"])
  return sd


def preprocessing_meta(cfg: ViTConfig, pretrained_cfg: Mapping[str, Any] | None = None,
                       **overrides: Any) -> dict[str, Any]:
  """Preprocessing metadata: timm's pretrained cfg if known, else the augreg defaults, then overrides."""
  meta = configs.default_preprocessing(cfg.img_size)
  for k in ("mean", "std", "interpolation", "crop_pct"):
    if pretrained_cfg and pretrained_cfg.get(k) is not None:
      meta[k] = pretrained_cfg[k]
    if overrides.get(k) is not None:
      meta[k] = overrides[k]
  meta["mean"], meta["std"] = [float(v) for v in meta["mean"]], [float(v) for v in meta["std"]]
  if len(meta["mean"]) != cfg.in_chans or len(meta["std"]) != cfg.in_chans:
    raise UserError(f"--mean/--std: expected {cfg.in_chans} values each")
  if not all(math.isfinite(v) for v in meta["mean"] + meta["std"]) or min(meta["std"]) <= 0:
    raise UserError(f"--mean/--std: expected finite values and std > 0, got mean {meta['mean']} std {meta['std']}")
  if meta["interpolation"] not in ("bicubic", "bilinear", "nearest", "lanczos"):
    raise UserError(f"--interpolation: expected bicubic, bilinear, nearest or lanczos, got '{meta['interpolation']}'")
  if not 0.0 < float(meta["crop_pct"]) <= 1.0:
    raise UserError(f"--crop-pct: expected a value in (0, 1], got {meta['crop_pct']}")
  meta["crop_pct"] = float(meta["crop_pct"])
  return meta
