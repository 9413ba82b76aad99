"""Converted model checkpoints: Flax params plus metadata, stored with orbax.

Layout of a checkpoint directory::

    DIR/params/   orbax StandardSave of the params pytree (float32)
    DIR/meta/     orbax JsonSave: the metadata record

Two kinds of model, told apart by the metadata's ``kind`` (ViT checkpoints written before the UNet have none):

* ``'vit'`` -- a timm ViT (`make_meta`): arch, model config, num_classes, img_size, patch_size and
  preprocessing (mean, std, interpolation, crop_pct);
* ``'unet'`` -- guided-diffusion's UNet (`make_unet_meta`): the `UNetConfig`, img_size and the diffusion
  settings it was trained with (diffusion_steps, noise_schedule, learn_sigma, ...).

Both load through one path with the same checks (metadata that parses, params that restore, match the model
exactly and are finite); only the model built from the metadata differs.

Usage::

    from pcsr_jax import checkpoint
    model, params, meta = checkpoint.load(DIR)
    logits = model.apply({'params': params}, x)     # ViT: x NHWC, normalized with meta['mean'], meta['std']
    out = model.apply({'params': params}, x, t)     # UNet: x NHWC in [-1, 1], t int32 [B]
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Mapping

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from pcsr_jax.errors import UserError
from pcsr_jax.models import ViTConfig, create
from pcsr_jax.models.unet import UNet, UNetConfig, example_inputs

FORMAT_VERSION = 1
# The metadata keys each kind of checkpoint must have.
REQUIRED_META = {"vit": ("arch", "model", "num_classes", "img_size", "mean", "std"),
                 "unet": ("model", "img_size", "diffusion")}
DIFFUSION_KEYS = ("diffusion_steps", "noise_schedule", "learn_sigma")


def make_meta(cfg: ViTConfig, preprocessing: Mapping[str, Any], source: str = "") -> dict[str, Any]:
  """The metadata record stored next to the params."""
  return dict(format_version=FORMAT_VERSION, arch=cfg.name, model=cfg.to_dict(), num_classes=cfg.num_classes,
              img_size=cfg.img_size, patch_size=cfg.patch_size, source=source, **dict(preprocessing))


def make_unet_meta(cfg: UNetConfig, diffusion: Mapping[str, Any], source: str = "") -> dict[str, Any]:
  """The metadata record of a diffusion checkpoint: the UNet config and the diffusion settings (guided-diffusion's
  ``diffusion_defaults()`` keys; `DIFFUSION_KEYS` at least)."""
  return dict(format_version=FORMAT_VERSION, kind="unet", arch="guided_diffusion_unet", model=cfg.to_dict(),
              img_size=cfg.image_size, diffusion=dict(diffusion), source=source)


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


def _damaged(directory: str, what: str, e: Exception) -> UserError:
  first = (str(e).strip().splitlines() or [""])[0][:160]
  return UserError(f"{directory}: {what} ({type(e).__name__}{': ' + first if first else ''}); re-create the "
                   f"checkpoint with convert_weights.py")


def load_meta(directory: str, kind: str | None = None) -> dict[str, Any]:
  """Reads only the metadata of a checkpoint directory, checking every field its kind needs; ``kind`` ('vit' or
  'unet') refuses a checkpoint of the other kind."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(os.path.join(directory, "params")) or not os.path.isdir(os.path.join(directory, "meta")):
    raise UserError(f"{directory}: not a pcsr-jax checkpoint (expected params/ and meta/ inside; "
                    f"make one with convert_weights.py)")
  try:
    # Parse the JSON first: orbax failing on it inside its async machinery also prints thread tracebacks.
    with open(os.path.join(directory, "meta", "metadata")) as f:
      json.load(f)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      meta = ckptr.restore(directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # not JSON, unreadable, a damaged orbax manifest: one line, not a traceback
    raise _damaged(directory, "checkpoint metadata unreadable", e) from None
  if not isinstance(meta, Mapping):
    raise UserError(f"{directory}: checkpoint metadata is a {type(meta).__name__}, expected a JSON object")
  kind_wanted, kind = kind, meta.get("kind", "vit")
  if kind not in REQUIRED_META:
    raise UserError(f"{directory}: checkpoint metadata has kind {kind!r}, expected one of {list(REQUIRED_META)}")
  if kind_wanted is not None and kind != kind_wanted:
    raise UserError(f"{directory}: a {kind} checkpoint, expected a {kind_wanted} one")
  for k in REQUIRED_META[kind]:
    if k not in meta:
      raise UserError(f"{directory}: checkpoint metadata lacks key '{k}'")
  if kind == "vit":
    check_preprocessing(meta, f"{directory}: checkpoint metadata")
  elif not isinstance(meta["diffusion"], Mapping) or any(k not in meta["diffusion"] for k in DIFFUSION_KEYS):
    raise UserError(f"{directory}: checkpoint metadata's 'diffusion' must be an object with keys "
                    f"{list(DIFFUSION_KEYS)}, got {meta['diffusion']!r}")
  return dict(meta)


def check_preprocessing(meta: Mapping[str, Any], where: str) -> None:
  """mean/std: finite numbers, one per channel, std > 0 (a zero std divides every image by zero)."""
  for k in ("mean", "std"):
    v = meta[k]
    if not isinstance(v, (list, tuple)) or not v or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
      raise UserError(f"{where}: '{k}' must be a list of finite numbers, got {v!r}")
  if min(meta["std"]) <= 0:
    raise UserError(f"{where}: 'std' must be positive, got {list(meta['std'])}")


def check_params(params: Any, model: nn.Module, inputs: tuple[Any, ...], where: str, what: str) -> None:
  """The params tree must be exactly ``model``'s for ``inputs`` (names and shapes; `jax.eval_shape`, no compute)
  and hold finite numbers only. ``what`` describes the model in the message."""
  expected = traverse_util.flatten_dict(jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"])
  got = traverse_util.flatten_dict(params)
  missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
  if missing or extra:
    name = lambda k: "/".join(k)
    raise UserError(f"{where}: params do not match the metadata's model ({what}): " +
                    (f"missing {name(missing[0])}" if missing else "") + (", " if missing and extra else "") +
                    (f"unexpected {name(extra[0])}" if extra else "") +
                    f" ({len(missing)} missing, {len(extra)} unexpected)")
  for k, v in expected.items():
    if tuple(got[k].shape) != tuple(v.shape):
      raise UserError(f"{where}: {'/'.join(k)} has shape {tuple(got[k].shape)}, the metadata's model needs "
                      f"{tuple(v.shape)}")
  bad = [k for k, v in got.items() if not np.isfinite(v).all()]
  if bad:
    raise UserError(f"{where}: {len(bad)} param arrays hold NaN or inf (e.g. {'/'.join(bad[0])})")


def _vit_model(directory: str, meta: Mapping[str, Any]) -> tuple[nn.Module, tuple[Any, ...], str]:
  cfg = ViTConfig.from_dict(meta["model"])
  for k, field in (("num_classes", "num_classes"), ("img_size", "img_size"), ("arch", "name")):
    if meta[k] != getattr(cfg, field):
      raise UserError(f"{directory}: checkpoint metadata says {k} {meta[k]} but its model config "
                      f"{getattr(cfg, field)}")
  x = jax.ShapeDtypeStruct((1, cfg.img_size, cfg.img_size, cfg.in_chans), np.float32)
  return create(cfg), (x,), f"{cfg.depth} blocks, width {cfg.embed_dim}, {cfg.num_classes} classes"


def _unet_model(directory: str, meta: Mapping[str, Any]) -> tuple[nn.Module, tuple[Any, ...], str]:
  try:
    cfg = UNetConfig.from_dict(dict(meta["model"]))
  except UserError as e:
    raise UserError(f"{directory}: checkpoint metadata has a bad model config ({e})") from None
  if meta["img_size"] != cfg.image_size:
    raise UserError(f"{directory}: checkpoint metadata says img_size {meta['img_size']} but its model config "
                    f"{cfg.image_size}")
  learn_sigma = meta["diffusion"]["learn_sigma"]
  if learn_sigma != (cfg.out_channels == 2 * cfg.in_channels):
    raise UserError(f"{directory}: checkpoint metadata says learn_sigma {learn_sigma} but its model has "
                    f"{cfg.out_channels} output channels for {cfg.in_channels} input channels")
  return UNet(cfg), example_inputs(cfg), (f"UNet, {cfg.image_size} px, num_channels {cfg.num_channels}, "
                                          f"channel_mult {list(cfg.channel_mult)}")


def _restore_params(directory: str) -> Any:
  """orbax's restore of the params, with this process's stderr (fd 2) captured meanwhile.

  When a read fails, orbax's event loop closes while its other reads are in flight; their callbacks then
  print "Event loop is closed" tracebacks from other threads, and asyncio logs each unretrieved task as it is
  collected. On failure that noise is dropped (after letting the reads settle) so the caller's one-line error
  stands alone; on success whatever was printed is passed on.
  """
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as buf:
    os.dup2(buf.fileno(), 2)
    try:
      with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        params = ckptr.restore(directory, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
    except Exception:
      logging.getLogger("asyncio").setLevel(logging.CRITICAL)
      time.sleep(2.0)
      gc.collect()
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    buf.seek(0)
    printed = buf.read()
  if printed:
    os.write(2, printed)
  return params


def load(directory: str, kind: str | None = None) -> tuple[nn.Module, dict, dict[str, Any]]:
  """Returns ``(model, params, meta)`` for a directory written by `save`, checked end to end: metadata that
  parses and is sane, params that restore, match the metadata's model exactly, and are finite. The model is a
  `VisionTransformer` or, for a diffusion checkpoint (``meta['kind'] == 'unet'``), a `UNet`; ``kind`` ('vit' or
  'unet') refuses the other."""
  meta = load_meta(directory, kind)
  directory = os.path.abspath(directory)
  build = _unet_model if meta.get("kind", "vit") == "unet" else _vit_model
  try:
    model, inputs, what = build(directory, meta)
  except (TypeError, ValueError) as e:
    raise _damaged(directory, "checkpoint metadata has a bad model config", e) from None
  try:
    params = _restore_params(directory)
  except Exception as e:  # a truncated or deleted array file, a damaged _METADATA: tensorstore / orbax errors
    raise _damaged(directory, "checkpoint params unreadable", e) from None
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  check_params(params, model, inputs, directory, what)
  return model, params, meta


def params_digest(params: Any) -> str:
  """SHA-256 over a checkpoint's params (names, shapes, float32 bytes): what the resume key, the source
  statistics' cache and DePT-G's prompts record of the model they were made with."""
  from flax import traverse_util

  h = hashlib.sha256()
  for k, v in sorted(traverse_util.flatten_dict(params).items()):
    a = np.ascontiguousarray(np.asarray(v, np.float32))
    h.update(f"{'/'.join(k)}:{a.shape}\n".encode())
    h.update(a.tobytes())
  return h.hexdigest()
