"""Generated test data: ImageNet-C-layout JPEG folders and a tiny 1000-class checkpoint."""

from __future__ import annotations

import os

import jax
import numpy as np
from PIL import Image

from pcsr_jax import checkpoint, weights
from pcsr_jax.data import imagenet
from pcsr_jax.models import ViTConfig, create, init_params

CKPT_CFG = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=1000,
                     mlp_ratio=2.0)


def make_imagenet_c(root: str, corruptions=("gaussian_noise", "fog"), severity: int = 5, classes: int = 4,
                    per_class: int = 5, size: int = 32, seed: int = 0) -> list[str]:
  """``<root>/<corruption>/<severity>/<wnid>/*.JPEG`` with real wnids; returns the wnids used."""
  rng = np.random.default_rng(seed)
  wnids = list(imagenet.wnids()[:: 1000 // classes][:classes])
  for c in corruptions:
    for w in wnids:
      d = os.path.join(root, c, str(severity), w)
      os.makedirs(d, exist_ok=True)
      for k in range(per_class):
        img = (rng.uniform(0, 255, (size, size, 3))).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(d, f"ILSVRC2012_val_{k:08d}.JPEG"), quality=90)
  return wnids


def make_imagenet_r(root: str, classes: int = 3, per_class: int = 3) -> str:
  """``<root>/<wnid>/*.jpg`` over the first ``classes`` of ImageNet-R's 200 wnids (40x48 random images); returns
  ``root``."""
  for w in imagenet.wnids("imagenet_r")[:classes]:
    os.makedirs(os.path.join(root, w))
    for k in range(per_class):
      Image.fromarray(np.random.default_rng(k).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
          os.path.join(root, w, f"{k}.jpg"))
  return root


def make_checkpoint(path: str, cfg: ViTConfig = CKPT_CFG, seed: int = 0) -> str:
  model = create(cfg)
  params = jax.tree.map(np.asarray, init_params(model, jax.random.key(seed)))
  params["head"]["kernel"] = params["head"]["kernel"] * 3.0  # some confident predictions
  meta = checkpoint.make_meta(cfg, weights.preprocessing_meta(cfg), source="random init")
  return checkpoint.save(path, params, meta)


def make_world(root, corruptions=("gaussian_noise", "fog"), classes: int = 4, per_class: int = 5):
  """``root/data`` (ImageNet-C layout) and ``root/ckpt`` (the tiny 1000-class checkpoint); returns ``root``."""
  make_imagenet_c(str(root / "data"), corruptions=corruptions, classes=classes, per_class=per_class)
  make_checkpoint(str(root / "ckpt"))
  return root


def open_units(out) -> list[dict]:
  """The saved positions (`progress.UnitProgress` as JSON: key, segment, batch, ...) of a run's units under way,
  read from ``<out>/resume/units/*/unit.json`` (files being replaced are skipped)."""
  import glob
  import json

  found = []
  for path in glob.glob(os.path.join(str(out), "resume", "units", "*", "unit.json")):
    try:
      with open(path) as f:
        rec = json.load(f)
    except (OSError, ValueError):
      continue
    if rec.get("progress"):
      found.append(rec["progress"])
  return found


def saved_units(out) -> dict:
  """A run's saved units by key (``<out>/resume``): their `progress.UnitRecord`s."""
  from pcsr_jax import progress

  resume = progress.Resume(str(out))
  return {k: r for k in resume.load()["units"] if (r := resume.load_unit(k)) is not None}


def same_predictions(a, b) -> list:
  """Asserts that two outputs' predictions files are the same files, equal array for array; their names."""
  files = sorted(os.listdir(a / "predictions"))
  assert files == sorted(os.listdir(b / "predictions"))
  for f in files:
    x, y = np.load(a / "predictions" / f), np.load(b / "predictions" / f)
    for k in ("file_names", "labels", "predictions"):
      np.testing.assert_array_equal(x[k], y[k], err_msg=f"{f}:{k}")
  return files
