"""Google's AugReg / big_vision ``.npz`` parameter names <-> timm's, as timm's ``_load_weights`` maps them."""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from pcsr_jax.errors import UserError
from pcsr_jax.weights import timm_map
from pcsr_jax.weights.timm_map import StateDict

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
  for i in range(timm_map.num_blocks(sd)):
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
