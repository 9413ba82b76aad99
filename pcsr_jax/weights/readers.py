"""Readers of checkpoint formats, each returning a state dict (numpy; timm-named for a ViT) and timm's pretrained
config.

* ``.safetensors`` -- read with ``safetensors.numpy`` (no torch);
* ``.pth`` / ``.pt`` / ``.bin`` -- a torch pickle (needs torch);
* ``.npz`` -- Google's AugReg / big_vision release (no torch), renamed by `big_vision`;
* ``timm:<model_name>[.<tag>]`` -- timm's own pretrained weights (needs torch, timm and network access).

Whatever the format, keys saved from a ``DataParallel``-wrapped model lose their ``module.`` prefix
(`strip_module_prefix`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from pcsr_jax.errors import UserError
from pcsr_jax.weights.big_vision import bigvision_to_timm
from pcsr_jax.weights.timm_map import StateDict


def read_state_dict(src: str) -> tuple[StateDict, dict[str, Any]]:
  """Reads a timm-named state dict from ``src``.

  Returns ``(state_dict, pretrained_cfg)``; the cfg is timm's pretrained config
  for ``timm:`` sources and empty otherwise.
  """
  sd, cfg = _read(src)
  return strip_module_prefix(sd, src), cfg


def strip_module_prefix(sd: StateDict, src: str) -> StateDict:
  """``sd`` without the ``module.`` prefix that ``torch.nn.DataParallel`` puts on every key (of any format)."""
  prefix = "module."
  out = {}
  for k, v in sd.items():
    name = k[len(prefix):] if k.startswith(prefix) else k
    if name in out:
      raise UserError(f"{src}: keys '{name}' and '{prefix}{name}' both present: expected one state dict")
    out[name] = v
  return out


def _read(src: str) -> tuple[StateDict, dict[str, Any]]:
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
  return {k: v.detach().float().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in obj.items()}


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
