"""DPAL's prompted ViT (``yushuntang/DPAL:models/dpal_transformer.py``, run with ``--prompt_deep``).

The backbone is `vit.VisionTransformer` (this module subclasses it), so its params keep timm's names. Extra
params, top-level:

* ``dpal_prompt`` ``[1, 1, D]``: the shallow prompt, put *before* the class token after the position embedding
  (it carries no position): the sequence is ``[prompt, class, patches]``; ``dpal_deep_prompts``
  ``[depth - 1, 1, D]`` replace token 0 before blocks 1 .. depth-1. Both uniform in ``+-sqrt(6 / (3 p^2 + D))``
  for ``p`` the patch size (0.0625 for ViT-B/16; the code's ``val``).
* ``dpal_pred_0`` .. ``dpal_pred_{depth-1}``: one predictor per block, fc1 (D -> D) -> exact GELU -> fc2 -> GELU,
  every weight and bias zero. After block ``i`` the class token (token 1) loses ``P_i(token 0)``, the *noise*.

The head reads token 1 after the final norm. With the zero init a predictor's output is ``GELU(fc2.bias)``,
the same for every sample; only ``fc2.bias`` ever gets a gradient (through the class token), so every
layer's noise rows are equal once it moved (`methods.dpal` on the similarity term).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcsr_jax.models.ops import gelu
from pcsr_jax.models.vit import VisionTransformer, init_params, vpt_bound

Array = jax.Array

PROMPT, DEEP, PRED = "dpal_prompt", "dpal_deep_prompts", "dpal_pred_"


class Predictor(nn.Module):
  """fc1 -> GELU -> fc2 -> GELU, zero-initialised (``dpal_transformer.py:29-32, 100-116``)."""

  dim: int
  cpu_ops: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    zero = nn.initializers.zeros
    x = gelu(nn.Dense(self.dim, kernel_init=zero, bias_init=zero, name="fc1")(x), self.cpu_ops)
    return gelu(nn.Dense(self.dim, kernel_init=zero, bias_init=zero, name="fc2")(x), self.cpu_ops)


def _uniform(bound: float):
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class DPALViT(VisionTransformer):
  """`VisionTransformer` with DPAL's shallow and deep prompts and its per-block predictors."""

  def setup(self):
    super().setup()
    c = self.config
    bound = vpt_bound(c)  # dpal_transformer.py:19-22 (its val, with 3 channels)
    self.dpal_prompt = self.param(PROMPT, _uniform(bound), (1, 1, c.embed_dim))
    self.dpal_deep_prompts = self.param(DEEP, _uniform(bound), (c.depth - 1, 1, c.embed_dim))
    self.dpal_pred = [Predictor(c.embed_dim, self.cpu_ops) for _ in range(c.depth)]

  def __call__(self, x: Array, noises: bool = False):
    """Logits ``[B, C]``; with ``noises`` also every block's predictor output ``[B, depth, D]`` (float32)."""
    x = self.patch_embed(x)
    b, d = x.shape[0], x.shape[-1]
    cls = jnp.broadcast_to(self.cls_token, (b, 1, d)).astype(x.dtype)
    pos = self.pos_embed if self.dtype is None else self.pos_embed.astype(self.dtype)
    x = jnp.concatenate([cls, x], axis=1) + pos
    prompt = lambda p: jnp.broadcast_to(p.astype(x.dtype), (b, 1, d))
    x = jnp.concatenate([prompt(self.dpal_prompt), x], axis=1)
    out = []
    for i, blk in enumerate(self.blocks):
      if i > 0:
        x = jnp.concatenate([prompt(self.dpal_deep_prompts[i - 1]), x[:, 1:]], axis=1)
      x = blk(x)
      noise = self.dpal_pred[i](x[:, 0].astype(jnp.float32))
      out.append(noise)
      x = x.at[:, 1].add(-noise.astype(x.dtype))
    feature = self.norm(x.astype(jnp.float32))[:, 1]
    logits = self.classify(feature)
    return (logits, jnp.stack(out, axis=1)) if noises else logits


def create(base: VisionTransformer) -> DPALViT:
  """The DPAL model of a plain one (its config, class subset, dtype and attention kernel)."""
  return DPALViT(config=base.config, recalibration=base.recalibration, class_subset=base.class_subset,
                 dtype=base.dtype, attention=base.attention, cpu_ops=base.cpu_ops)


def is_extra(path: tuple[str, ...]) -> bool:
  """Whether a param path is DPAL's own (prompts, predictors) rather than the timm backbone's."""
  return path[0] in (PROMPT, DEEP) or path[0].startswith(PRED)


def init_extra(model: DPALViT, rng: Array) -> dict[str, Any]:
  """Freshly initialised prompts and zero predictors (the backbone's params are the checkpoint's)."""
  return init_params(model, rng, only=lambda name: is_extra((name,)))
