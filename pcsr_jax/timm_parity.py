"""Parity checks against timm itself (needs the ``convert`` extra: torch + timm).

Imported lazily by ``convert_weights.py --verify`` and the tests; the core
package never imports torch.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from pcsr_jax.models import ViTConfig, create


def timm_model(cfg: ViTConfig, state_dict: Mapping[str, np.ndarray] | None = None):
  """timm's ``VisionTransformer`` for ``cfg`` (eval mode), loaded with ``state_dict`` if given."""
  import torch
  from timm.models.vision_transformer import VisionTransformer

  model = VisionTransformer(img_size=cfg.img_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
                            num_classes=cfg.num_classes, embed_dim=cfg.embed_dim, depth=cfg.depth,
                            num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, class_token=True,
                            global_pool="token")
  if state_dict is not None:
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict.items()})
  return model.eval()


def randomize_(model, seed: int = 0, scale: float = 0.05) -> None:
  """Randomizes every parameter of a torch model in place, LayerNorm and biases included.

  LayerNorm scales become 1 + N(0, 0.1^2) (all-ones would hide a transposed
  scale); everything else N(0, scale^2), so that no bias is zero.
  """
  import torch

  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      is_ln_scale = name.endswith(("norm1.weight", "norm2.weight")) or name == "norm.weight"
      p.copy_(1.0 + 0.1 * noise if is_ln_scale else scale * noise)


def random_model(cfg: ViTConfig, seed: int = 0, scale: float = 0.15):
  """``(timm model, its state dict as numpy)``: every parameter randomized (the agreement tests' models)."""
  model = timm_model(cfg)
  randomize_(model, seed=seed, scale=scale)
  return model, {k: v.numpy() for k, v in model.state_dict().items()}


def timm_logits(model, x_nhwc: np.ndarray) -> np.ndarray:
  """timm logits for NHWC float32 input."""
  import torch

  with torch.no_grad():
    return model(torch.from_numpy(np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2)))).numpy()


def max_logit_diff(cfg: ViTConfig, params: Any, state_dict: Mapping[str, np.ndarray], batch_size: int = 2,
                   seed: int = 0) -> tuple[float, float]:
  """Max |Flax - timm| over the logits of a random batch, and the max |logit| for scale.

  Uses float32 with ``jax_default_matmul_precision='highest'`` (no TF32 on GPUs).
  """
  x = np.random.default_rng(seed).standard_normal((batch_size, cfg.img_size, cfg.img_size, cfg.in_chans),
                                                  dtype=np.float32)
  ref = timm_logits(timm_model(cfg, state_dict), x)
  with jax.default_matmul_precision("highest"):
    out = np.asarray(jax.jit(create(cfg).apply)({"params": params}, x))
  return float(np.abs(out - ref).max()), float(np.abs(ref).max())
