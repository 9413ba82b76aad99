"""Tiny models and batches shared by the engine tests (a few thousand params; CPU-fast)."""

from __future__ import annotations

import jax
import numpy as np

from pcsr_jax.models import ViTConfig, create, init_params

TINY = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


def tiny_model(cfg: ViTConfig = TINY, seed: int = 0, head_scale: float = 3.0):
  """A random tiny ViT whose head is scaled up so that some predictions are confident (entropy < E0)."""
  model = create(cfg)
  params = init_params(model, jax.random.key(seed))
  params = jax.tree.map(np.asarray, params)
  params["head"]["kernel"] = params["head"]["kernel"] * head_scale
  return model, params


def batches(n: int, batch_size: int, cfg: ViTConfig = TINY, seed: int = 0, last: int | None = None):
  rng = np.random.default_rng(seed)
  sizes = [batch_size] * n if last is None else [batch_size] * (n - 1) + [last]
  return [rng.standard_normal((s, cfg.img_size, cfg.img_size, cfg.in_chans)).astype(np.float32) for s in sizes]
