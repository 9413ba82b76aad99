"""Converted model checkpoints: Flax params plus metadata, stored with orbax.

Layout of a checkpoint directory::

    DIR/params/   orbax StandardSave of the params pytree (float32)
    DIR/meta/     orbax JsonSave: arch, model config, num_classes, img_size,
                  patch_size and preprocessing (mean, std, interpolation, crop_pct)

Usage::

    from pcsr_jax import checkpoint
    model, params, meta = checkpoint.load(DIR)
    logits = model.apply({'params': params}, x)  # x: NHWC, normalized with meta['mean'], meta['std']
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from pcsr_jax.errors import UserError
from pcsr_jax.models import ViTConfig, VisionTransformer, create

FORMAT_VERSION = 1


def make_meta(cfg: ViTConfig, preprocessing: Mapping[str, Any], source: str = "") -> dict[str, Any]:
  """The metadata record stored next to the params."""
  return dict(format_version=FORMAT_VERSION, arch=cfg.name, model=cfg.to_dict(), num_classes=cfg.num_classes,
              img_size=cfg.img_size, patch_size=cfg.patch_size, source=source, **dict(preprocessing))


def save(directory: str, params: Any, meta: Mapping[str, Any], force: bool = False) -> str:
  """Writes ``params`` and ``meta`` to ``directory`` (which must not exist unless ``force``)."""
  directory = os.path.abspath(directory)
  if os.path.exists(directory) and not force:
    raise UserError(f"{directory}: output dir exists (pass --force to overwrite)")
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(directory, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                  meta=ocp.args.JsonSave(dict(meta))), force=force)
  return directory


def load_meta(directory: str) -> dict[str, Any]:
  """Reads only the metadata of a checkpoint directory."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(os.path.join(directory, "params")) or not os.path.isdir(os.path.join(directory, "meta")):
    raise UserError(f"{directory}: not a pcsr-jax checkpoint (expected params/ and meta/ inside; "
                    f"make one with convert_weights.py)")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    meta = ckptr.restore(directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  for k in ("arch", "model", "num_classes", "img_size", "mean", "std"):
    if k not in meta:
      raise UserError(f"{directory}: checkpoint metadata lacks key '{k}'")
  return dict(meta)


def load(directory: str) -> tuple[VisionTransformer, dict, dict[str, Any]]:
  """Returns ``(model, params, meta)`` for a directory written by `save`."""
  meta = load_meta(directory)
  cfg = ViTConfig.from_dict(meta["model"])
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    params = ckptr.restore(os.path.abspath(directory),
                           args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  return create(cfg), params, meta
