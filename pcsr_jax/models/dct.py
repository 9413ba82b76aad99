"""DCT's generated q/k/v token (``yushuntang/DCT:models/dct_attention.py``), as a spec `vit.VisionTransformer`
takes (``qkv_tokens``).

In each listed block a ``Linear(D, 3D)`` *generator* maps the block's normed class token (row 0 of the
attention's input) to one more token's query, key and value (split as ``qkv``'s rows: q | k | v, head-major),
appended after the block's tokens; the attention runs over them all and the extra token's output row is dropped.
Its query acts on nothing, so the q third of the generator gets no gradient. The generators are top-level params
``qkv_gen_0`` ... (the j-th listed block's), beside the timm backbone's tree. Their init is PyTorch's default
``nn.Linear`` init, uniform in +-1/sqrt(D) for weight and bias, as the official code leaves them: the model
before adaptation is not the source model.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

PREFIX = "qkv_gen_"


def torch_linear_uniform(fan_in: int):
  """PyTorch's default ``nn.Linear`` init of weight (kaiming uniform, a = sqrt 5) and bias: U(+-1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


@dataclasses.dataclass(frozen=True)
class DCTConfig:
  """The blocks whose attention gets a generated token (the code's blocks 0-8 of ViT-B)."""

  blocks: tuple[int, ...] = tuple(range(9))

  def make(self, dim: int, dtype=None) -> nn.Module:
    init = torch_linear_uniform(dim)
    return nn.Dense(3 * dim, dtype=dtype, kernel_init=init, bias_init=init)


def is_generator_param(path: tuple[str, ...]) -> bool:
  return path[0].startswith(PREFIX)


def generator_index(path: tuple[str, ...]) -> int:
  """j of a ``qkv_gen_j`` param: the position of its block in `DCTConfig.blocks`, not the block's index."""
  return int(path[0][len(PREFIX):])
