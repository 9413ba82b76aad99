"""timm ViT checkpoints -> Flax params, and back.

Sources (see `read_state_dict`):

* ``.safetensors`` -- read with ``safetensors.numpy`` (no torch);
* ``.pth`` / ``.pt`` / ``.bin`` -- a torch pickle (needs torch);
* ``.npz`` -- Google's AugReg / big_vision release, big_vision parameter names
  (no torch), translated to timm names exactly as timm's ``_load_weights`` does;
* ``timm:<model_name>[.<tag>]`` -- timm's own pretrained weights (needs torch,
  timm and network access).

The map between a timm state dict and the Flax tree is one-to-one:

==================================  ===========================================
timm                                Flax (`pcsr_jax.models.vit`)
==================================  ===========================================
patch_embed.proj.weight [D,C,p,p]   patch_embed/proj/kernel [p,p,C,D]
cls_token, pos_embed                cls_token, pos_embed (same shape)
blocks.i.norm1.weight / .bias       blocks_i/norm1/scale / bias
blocks.i.attn.qkv.weight [3D,D]     blocks_i/attn/qkv/kernel [D,3D]
blocks.i.<lin>.weight [out,in]      blocks_i/<lin>/kernel [in,out]
norm.weight, head.weight            norm/scale, head/kernel
==================================  ===========================================
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

import numpy as np

from pcsr_jax.errors import UserError
from pcsr_jax.models import configs
from pcsr_jax.models.configs import ViTConfig

StateDict = dict[str, np.ndarray]

_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
_NORMS = ("norm1", "norm2")


# ----------------------------------------------------------------------------- reading


def read_state_dict(src: str) -> tuple[StateDict, dict[str, Any]]:
  """Reads a timm-named state dict from ``src``.

  Returns ``(state_dict, pretrained_cfg)``; the cfg is timm's pretrained config
  for ``timm:`` sources and empty otherwise.
  """
  if src.startswith("timm:"):
    return _read_timm_hub(src[len("timm:"):])
  if not os.path.isfile(src):
    raise UserError(f"{src}: no such file")
  ext = os.path.splitext(src)[1].lower()
  if ext == ".safetensors":
    from safetensors.numpy import load_file
    try:
      sd = load_file(src)
    except Exception as e:  # safetensors raises its own error types
      raise UserError(f"{src}: not a readable .safetensors file ({e})") from None
    return {k: np.asarray(v) for k, v in sd.items()}, {}
  if ext in (".pth", ".pt", ".bin"):
    return _read_torch(src), {}
  if ext == ".npz":
    try:
      with np.load(src, allow_pickle=False) as f:
        npz = {k: f[k] for k in f.files}
    except Exception as e:
      raise UserError(f"{src}: not a readable .npz file ({e})") from None
    return bigvision_to_timm(npz, src), {}
  raise UserError(f"{src}: unsupported extension '{ext}': expected .safetensors, .pth, .pt, .bin, .npz "
                  f"or timm:<model_name>")


def _require_torch(what: str):
  try:
    import torch
  except ImportError:
    raise UserError(f"{what} needs PyTorch: pip install 'pcsr-jax[convert]'") from None
  return torch


def _read_torch(src: str) -> StateDict:
  torch = _require_torch(f"{src}: reading a torch checkpoint")
  try:
    obj = torch.load(src, map_location="cpu", weights_only=True)
  except Exception as e:
    raise UserError(f"{src}: not a readable torch checkpoint ({type(e).__name__})") from None
  for key in ("state_dict", "model", "state_dict_ema", "model_ema"):  # common training wrappers
    if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
      obj = obj[key]
      break
  if not isinstance(obj, Mapping):
    raise UserError(f"{src}: expected a state dict, got {type(obj).__name__}")
  sd = {}
  for k, v in obj.items():
    k = k[len("module."):] if k.startswith("module.") else k  # DataParallel prefix
    sd[k] = v.detach().float().numpy() if hasattr(v, "detach") else np.asarray(v)
  return sd


def _read_timm_hub(name: str) -> tuple[StateDict, dict[str, Any]]:
  _require_torch(f"timm:{name}")
  try:
    import timm
  except ImportError:
    raise UserError(f"timm:{name} needs timm: pip install 'pcsr-jax[convert]'") from None
  try:
    model = timm.create_model(name, pretrained=True)
  except Exception as e:
    raise UserError(f"timm:{name}: timm could not create it with pretrained weights ({e})") from None
  cfg = dict(model.pretrained_cfg)
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}, cfg


# ------------------------------------------------------------------------- big_vision

# Sub-module indices inside an encoder block: (attention, second LayerNorm, MLP).
_AUGREG_BLOCK = ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")  # google-research/vision_transformer
_BIGVISION_BLOCK = ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")  # google-research/big_vision


def _bv_prefix(npz: Mapping[str, np.ndarray]) -> str:
  for prefix in ("opt/target/", "params/", ""):
    if f"{prefix}embedding/kernel" in npz:
      return prefix
  return ""


def bigvision_to_timm(npz: Mapping[str, np.ndarray], src: str = "npz") -> StateDict:
  """Google AugReg / big_vision ``.npz`` names -> a timm state dict.

  Follows timm's ``_load_weights``: a file is big_vision-style when its names
  start with ``params/``, its position embedding sits at top-level
  ``pos_embedding`` or its blocks are scanned (``Transformer/encoderblock/`` with
  a leading depth axis); it then uses the block layout LayerNorm_0,
  MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0. Otherwise it is the
  original AugReg layout (``Transformer/posembed_input/pos_embedding``;
  LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3). A
  big_vision 'tok' model adds no position embedding to the class token; that is
  exactly a zero class slot in timm's pos_embed.
  """
  p = _bv_prefix(npz)
  w = {k[len(p):]: np.asarray(v) for k, v in npz.items() if k.startswith(p)}
  foreign = sorted(k for k in npz if not k.startswith(p))
  scanned = "Transformer/encoderblock/LayerNorm_0/scale" in w
  big_vision = p.startswith("params/") or "pos_embedding" in w or scanned
  mha, ln2, mlp = _BIGVISION_BLOCK if big_vision else _AUGREG_BLOCK
  used: set[str] = set()

  def take(name: str, idx: int | None = None) -> np.ndarray:
    if name not in w:
      raise UserError(f"{src}: missing key '{p}{name}'")
    used.add(name)
    return w[name] if idx is None else w[name][idx]

  kernel = take("embedding/kernel")  # [p, p, C, D] (HWIO)
  d = kernel.shape[-1]
  sd: StateDict = {
      "patch_embed.proj.weight": kernel.transpose(3, 2, 0, 1),
      "patch_embed.proj.bias": take("embedding/bias"),
      "cls_token": take("cls").reshape(1, 1, d),
      "norm.weight": take("Transformer/encoder_norm/scale"),
      "norm.bias": take("Transformer/encoder_norm/bias"),
  }
  pos = take("pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding").reshape(1, -1, d)
  if int(round(pos.shape[1] ** 0.5)) ** 2 == pos.shape[1]:  # no class slot (big_vision 'tok' pooling)
    pos = np.concatenate([np.zeros((1, 1, d), pos.dtype), pos], axis=1)
  sd["pos_embed"] = pos
  if "head/kernel" in w:
    sd["head.weight"] = take("head/kernel").T
    sd["head.bias"] = take("head/bias")

  if scanned:
    depth = w["Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
  else:
    depth = 1 + max([int(m.group(1)) for k in w if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))],
                    default=-1)
  for i in range(depth):
    b, idx = ("Transformer/encoderblock/", i) if scanned else (f"Transformer/encoderblock_{i}/", None)
    g = lambda name: take(b + name, idx)
    t = f"blocks.{i}."
    sd[t + "norm1.weight"], sd[t + "norm1.bias"] = g("LayerNorm_0/scale"), g("LayerNorm_0/bias")
    sd[t + "norm2.weight"], sd[t + "norm2.bias"] = g(f"{ln2}/scale"), g(f"{ln2}/bias")
    # query/key/value kernels are [D, H, Dh]; timm's fused qkv rows are q | k | v, head-major.
    sd[t + "attn.qkv.weight"] = np.concatenate(
        [g(f"{mha}/{n}/kernel").reshape(d, -1).T for n in ("query", "key", "value")], axis=0)
    sd[t + "attn.qkv.bias"] = np.concatenate([g(f"{mha}/{n}/bias").reshape(-1) for n in ("query", "key", "value")])
    sd[t + "attn.proj.weight"] = g(f"{mha}/out/kernel").reshape(-1, d).T
    sd[t + "attn.proj.bias"] = g(f"{mha}/out/bias")
    for j, fc in ((0, "fc1"), (1, "fc2")):
      sd[t + f"mlp.{fc}.weight"] = g(f"{mlp}/Dense_{j}/kernel").T
      sd[t + f"mlp.{fc}.bias"] = g(f"{mlp}/Dense_{j}/bias")

  unexpected = foreign + sorted(p + k for k in w if k not in used)
  if unexpected:
    raise UserError(f"{src}: unexpected keys {unexpected}")
  return sd


def timm_to_bigvision(sd: Mapping[str, np.ndarray], num_heads: int, layout: str = "augreg") -> dict[str, np.ndarray]:
  """The inverse of `bigvision_to_timm`.

  ``layout='augreg'`` writes the original AugReg release names;
  ``layout='big_vision'`` writes big_vision's (``params/`` prefix, top-level
  ``pos_embedding``, class slot kept).
  """
  if layout not in ("augreg", "big_vision"):
    raise ValueError(f"layout must be 'augreg' or 'big_vision', got {layout!r}")
  big_vision = layout == "big_vision"
  mha, ln2, mlp = _BIGVISION_BLOCK if big_vision else _AUGREG_BLOCK
  d = sd["cls_token"].shape[-1]
  dh = d // num_heads
  out = {
      "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
      "embedding/bias": sd["patch_embed.proj.bias"],
      "cls": sd["cls_token"],
      ("pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"): sd["pos_embed"],
      "Transformer/encoder_norm/scale": sd["norm.weight"],
      "Transformer/encoder_norm/bias": sd["norm.bias"],
  }
  if "head.weight" in sd:
    out["head/kernel"], out["head/bias"] = sd["head.weight"].T, sd["head.bias"]
  for i in range(_depth(sd)):
    t, b = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
    out[b + "LayerNorm_0/scale"], out[b + "LayerNorm_0/bias"] = sd[t + "norm1.weight"], sd[t + "norm1.bias"]
    out[b + f"{ln2}/scale"], out[b + f"{ln2}/bias"] = sd[t + "norm2.weight"], sd[t + "norm2.bias"]
    qkv_w = sd[t + "attn.qkv.weight"].reshape(3, d, d)
    qkv_b = sd[t + "attn.qkv.bias"].reshape(3, num_heads, dh)
    for j, n in enumerate(("query", "key", "value")):
      out[b + f"{mha}/{n}/kernel"] = qkv_w[j].T.reshape(d, num_heads, dh)
      out[b + f"{mha}/{n}/bias"] = qkv_b[j]
    out[b + f"{mha}/out/kernel"] = sd[t + "attn.proj.weight"].T.reshape(num_heads, dh, d)
    out[b + f"{mha}/out/bias"] = sd[t + "attn.proj.bias"]
    for j, fc in ((0, "fc1"), (1, "fc2")):
      out[b + f"{mlp}/Dense_{j}/kernel"] = sd[t + f"mlp.{fc}.weight"].T
      out[b + f"{mlp}/Dense_{j}/bias"] = sd[t + f"mlp.{fc}.bias"]
  return {("params/" + k if big_vision else k): v for k, v in out.items()}


# ---------------------------------------------------------------------- timm <-> flax


def _depth(sd: Mapping[str, Any]) -> int:
  idx = [int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))]
  return max(idx) + 1 if idx else 0


def infer_config(sd: Mapping[str, np.ndarray], src: str = "checkpoint", arch: str | None = None,
                 num_classes: int | None = None) -> ViTConfig:
  """The `ViTConfig` of a timm state dict, from ``arch`` or else from its shapes."""
  for k in ("patch_embed.proj.weight", "pos_embed", "cls_token"):
    if k not in sd:
      raise UserError(f"{src}: missing key '{k}': not a timm VisionTransformer state dict")
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
  depth = _depth(sd)
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
  exp = expected_shapes(cfg)
  missing = sorted(set(exp) - set(sd))
  unexpected = sorted(set(sd) - set(exp))
  if missing or unexpected:
    parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else ""]
    raise UserError(f"{src}: state dict does not match {cfg.name}: " + "; ".join(p for p in parts if p))
  for k, shape in exp.items():
    if tuple(sd[k].shape) != shape:
      raise UserError(f"{src}: shape mismatch for '{k}': checkpoint {tuple(sd[k].shape)}, "
                      f"{cfg.name} expects {shape}")


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
  if meta["interpolation"] not in ("bicubic", "bilinear", "nearest", "lanczos"):
    raise UserError(f"--interpolation: expected bicubic, bilinear, nearest or lanczos, got '{meta['interpolation']}'")
  if not 0.0 < float(meta["crop_pct"]) <= 1.0:
    raise UserError(f"--crop-pct: expected a value in (0, 1], got {meta['crop_pct']}")
  meta["crop_pct"] = float(meta["crop_pct"])
  return meta
