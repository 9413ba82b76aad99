"""Tiny models and batches shared by the engine tests (a few thousand params; CPU-fast)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from pcsr_jax.models import ViTConfig, create, init_params

TINY = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


@functools.lru_cache(maxsize=None)
def _tiny_model(cfg: ViTConfig, seed: int, head_scale: float):
  model = create(cfg)
  params = jax.tree.map(np.asarray, init_params(model, jax.random.key(seed)))
  params["head"]["kernel"] = params["head"]["kernel"] * head_scale
  return model, params


def tiny_model(cfg: ViTConfig = TINY, seed: int = 0, head_scale: float = 3.0):
  """A random tiny ViT whose head is scaled up so that some predictions are confident (entropy < E0).

  Initialized once per arguments (the init is a compile); each call gets its own copy of the params.
  """
  model, params = _tiny_model(cfg, seed, head_scale)
  return model, jax.tree.map(np.array, params)


def batches(n: int, batch_size: int, cfg: ViTConfig = TINY, seed: int = 0, last: int | None = None):
  rng = np.random.default_rng(seed)
  sizes = [batch_size] * n if last is None else [batch_size] * (n - 1) + [last]
  return [rng.standard_normal((s, cfg.img_size, cfg.img_size, cfg.in_chans)).astype(np.float32) for s in sizes]
