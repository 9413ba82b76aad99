"""The conversion pipeline behind ``convert_weights.py``: read, check, map, save, verify (a timm ViT), or read,
check, map, save (a guided-diffusion UNet)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pcsr_jax import checkpoint
from pcsr_jax.weights import guided_diffusion, readers, timm_map
from pcsr_jax.errors import UserError


def _check_out(out: str, force: bool) -> None:
  """Fails before the (possibly slow) read when ``out`` exists or cannot be created."""
  if os.path.exists(out) and not force:
    raise UserError(f"{os.path.abspath(out)}: output dir exists (pass --force to overwrite)")
  parent = os.path.dirname(os.path.abspath(out))
  while not os.path.exists(parent):  # the nearest existing ancestor is where the new folders will go
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
    raise UserError(f"--out {out}: {parent} is not a writable directory")


def convert_checkpoint(src: str, out: str, arch: str | None = None, num_classes: int | None = None,
                       force: bool = False, verify: bool = False, **preprocessing: Any) -> dict[str, Any]:
  """Converts ``src`` into a checkpoint directory ``out``; returns a summary dict.

  ``preprocessing`` overrides (mean, std, interpolation, crop_pct) take
  precedence over timm's pretrained config, which takes precedence over the
  augreg defaults.
  """
  _check_out(out, force)
  if verify:
    try:
      import timm  # noqa: F401
      import torch  # noqa: F401
    except ImportError:
      raise UserError("--verify needs torch and timm: pip install 'pcsr-jax[convert]'") from None
  sd, pretrained_cfg = readers.read_state_dict(src)
  if arch is None and pretrained_cfg.get("architecture"):
    arch = pretrained_cfg["architecture"]
  cfg = timm_map.infer_config(sd, src, arch=arch, num_classes=num_classes)
  params = timm_map.timm_to_flax(sd, cfg, src)
  meta = checkpoint.make_meta(cfg, timm_map.preprocessing_meta(cfg, pretrained_cfg, **preprocessing), source=src)
  path = checkpoint.save(out, params, meta, force=force)
  result = dict(out=path, meta=meta, num_params=int(sum(np.size(v) for v in sd.values())))
  if verify:
    from pcsr_jax import timm_parity

    result["max_abs_diff"], result["max_abs_logit"] = timm_parity.max_logit_diff(cfg, params, sd)
  return result


def convert_unet(src: str, out: str, unet_config: str, force: bool = False) -> dict[str, Any]:
  """Converts a guided-diffusion UNet state dict ``src`` (``.pt``/``.pth``/``.bin``, ``.safetensors``) into a
  diffusion checkpoint directory ``out``, configured by ``unet_config`` (`guided_diffusion.read_flags`)."""
  flags, where = guided_diffusion.read_flags(unet_config)  # a bad config fails before the read
  cfg, diffusion = guided_diffusion.config_from_flags(flags, where)
  _check_out(out, force)
  ext = os.path.splitext(src)[1].lower()
  if src.startswith("timm:") or ext == ".npz":
    raise UserError(f"{src}: a guided-diffusion UNet comes as .pt, .pth, .bin or .safetensors")
  sd, _ = readers.read_state_dict(src)
  params = guided_diffusion.torch_to_flax(sd, cfg, src)
  meta = checkpoint.make_unet_meta(cfg, diffusion, source=src)
  path = checkpoint.save(out, params, meta, force=force)
  return dict(out=path, meta=meta, num_params=int(sum(np.size(v) for v in sd.values())))
