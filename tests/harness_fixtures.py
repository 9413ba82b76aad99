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
