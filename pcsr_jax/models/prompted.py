"""DePT's prompted ViT (``yhygao/DePT:classifier.py`` ``ViT_DePT``) and its DINO heads (``model/dept_dino.py``).

The backbone is `vit.VisionTransformer` itself (this module subclasses it), so its params keep timm's names
(``blocks_3/attn/qkv``...) and are the same arrays every other method adapts. Extra params, top-level:

* ``prompts`` ``[S, P, D]``: ``P`` prompt tokens per stage for ``S`` stages; the ``depth`` blocks are cut into
  ``S`` equal stages (``depth // S`` blocks each, as ``ViT_DePT`` does; ``S`` must divide the depth).
  Xavier-uniform init of each stage's ``(1, P, D)`` tensor (torch's fans for a 3-D tensor: fan_in ``P * D``,
  fan_out ``D``).
* ``dino_0`` .. ``dino_{S-1}``: one DINO head per stage (``hierarchy=True``): ``layers - 1`` Linear + exact
  GELU layers of width ``hidden``, a Linear to ``bottleneck``, an L2 normalisation, then a weight-normalised
  Linear to ``out_dim`` without bias whose gain is fixed at 1 (``norm_last_layer=True``): its kernel is the
  stored ``last_v`` with each output column scaled to unit norm. Linear weights ``N(0, 0.02)`` (torch's
  ``trunc_normal_`` at +-2, which at std 0.02 truncates nothing), biases 0; ``last_v`` torch's default Linear
  init.

Forward (``ViT_DePT.forward``): patch embedding, class token and position embedding as the plain ViT; then
stage 0's prompts are PREPENDED, before the class token (they carry no position); after each stage the
``P`` prompt outputs are taken off (kept as that stage's prompt output) and the next stage's prompts put
in their place; after the last stage the final LayerNorm is applied to every token. The feature is the token
at index ``P`` (the class token after the prompts), the logits are the head on it, and the last stage's prompt
output is the normalised one (the earlier ones are not), as in the official code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcsr_jax.errors import UserError
from pcsr_jax.models.ops import gelu
from pcsr_jax.models.vit import VisionTransformer, init_params

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  """The prompts and DINO heads (official ImageNet script: 4 stages x 50 prompts, 2-layer heads, 2048 out)."""

  stages: int = 4
  prompts: int = 50
  dino_layers: int = 2  # model.nlayer_head
  dino_hidden: int = 2048
  dino_bottleneck: int = 256
  dino_out: int = 2048  # model.out_dim

  def check(self, depth: int, where: str = "prompts") -> None:
    for k, v in dataclasses.asdict(self).items():
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{where} {k}: expected a positive integer, got {v!r}")
    if self.dino_layers < 2:
      raise UserError(f"{where} dino_layers: expected at least 2 (the official scripts use 2), got {self.dino_layers}")
    if depth % self.stages:
      raise UserError(f"{where} stages: expected a divisor of the model's {depth} blocks, got {self.stages}")

  def to_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


def xavier_prompts(key: Array, shape: tuple[int, int, int], dtype=jnp.float32) -> Array:
  """``[S, P, D]``: each stage's ``(1, P, D)`` tensor by torch's ``xavier_uniform_`` (fan_in P*D, fan_out D)."""
  _, p, d = shape
  bound = math.sqrt(6.0 / (p * d + d))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def _torch_linear_init(key: Array, shape: tuple[int, int], dtype=jnp.float32) -> Array:
  """torch ``nn.Linear``'s default weight init (kaiming uniform, a = sqrt 5): U(+-1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(shape[0])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


class DINOHead(nn.Module):
  """DINO's projection head with a weight-normalised last layer of fixed gain (see the module docstring)."""

  cfg: PromptConfig
  cpu_ops: bool = True  # `ops.gelu`'s hand-written backward (a CPU's)

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.cfg
    init = nn.initializers.normal(0.02)
    for i in range(c.dino_layers - 1):
      x = gelu(nn.Dense(c.dino_hidden, kernel_init=init, name=f"fc{i}")(x), self.cpu_ops)
    x = nn.Dense(c.dino_bottleneck, kernel_init=init, name=f"fc{c.dino_layers - 1}")(x)
    x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)  # F.normalize
    v = self.param("last_v", _torch_linear_init, (c.dino_bottleneck, c.dino_out))
    return x @ (v / jnp.linalg.norm(v, axis=0, keepdims=True))  # weight_norm(dim=0) with g = 1


class PromptedViT(VisionTransformer):
  """`VisionTransformer` with DePT's stage prompts and one DINO head per stage (module docstring)."""

  prompt: Optional[PromptConfig] = None

  def setup(self):
    super().setup()
    c, pc = self.config, self.prompt
    if pc is None:
      raise UserError("PromptedViT: needs a PromptConfig")
    pc.check(c.depth)
    self.prompts = self.param("prompts", xavier_prompts, (pc.stages, pc.prompts, c.embed_dim))
    self.dino = [DINOHead(pc, self.cpu_ops) for _ in range(pc.stages)]

  def __call__(self, x: Array, outputs: bool = False):
    """Logits ``[B, C]``; with ``outputs`` ``(feature [B, D], logits, prompt outputs [S, B, P, D])``."""
    c, pc = self.config, self.prompt
    per_stage = c.depth // pc.stages
    x = self.patch_embed(x)
    b = x.shape[0]
    cls = jnp.broadcast_to(self.cls_token, (b, 1, x.shape[-1])).astype(x.dtype)
    pos = self.pos_embed if self.dtype is None else self.pos_embed.astype(self.dtype)
    x = jnp.concatenate([cls, x], axis=1) + pos
    stage_prompts = lambda i: jnp.broadcast_to(self.prompts[i].astype(x.dtype), (b, pc.prompts, c.embed_dim))
    outs = []
    for s in range(pc.stages):
      x = jnp.concatenate([stage_prompts(s), x if s == 0 else x[:, pc.prompts:]], axis=1)
      for blk in self.blocks[s * per_stage:(s + 1) * per_stage]:
        x = blk(x)
      if s < pc.stages - 1:
        outs.append(x[:, :pc.prompts])
    f32 = (lambda a: a) if self.dtype is None else (lambda a: a.astype(jnp.float32))
    x = self.norm(f32(x))
    outs.append(x[:, :pc.prompts])
    feature = x[:, pc.prompts]
    logits = self.classify(feature)
    if not outputs:
      return logits
    return feature, logits, jnp.stack([f32(o) for o in outs])

  def dino_outputs(self, feature: Array, prompt_outs: Array) -> tuple[Array, Array]:
    """``DePTDino.multi_crop_forward`` with ``consistency_type='cls_prompt'``, ``hierarchy=True``: the last stage's
    head on the feature ``[B, out]``, and stage ``s``'s head on stage ``s``'s prompt outputs ``[S, B, P, out]``."""
    prompt = jnp.stack([self.dino[s](prompt_outs[s]) for s in range(self.prompt.stages)])
    return self.dino[-1](feature), prompt


def create(base: VisionTransformer, prompt: PromptConfig) -> PromptedViT:
  """The prompted model of a plain one (its config, class subset, dtype and attention kernel)."""
  return PromptedViT(config=base.config, recalibration=base.recalibration, class_subset=base.class_subset,
                     dtype=base.dtype, attention=base.attention, cpu_ops=base.cpu_ops, prompt=prompt)


EXTRA = "prompts"  # top-level param names that are not the backbone's: ``prompts`` and ``dino_<i>``


def is_extra(path: tuple[str, ...]) -> bool:
  """Whether a param path is DePT's own (prompts, DINO heads) rather than the timm backbone's."""
  return path[0] == EXTRA or path[0].startswith("dino_")


def init_extra(model: PromptedViT, rng: Array) -> dict[str, Any]:
  """Freshly initialised prompts and DINO heads (the backbone's params are the checkpoint's)."""

  def everything(m, images):  # the forward pass and the DINO heads: every param is reached
    feature, _, outs = m(images, outputs=True)
    return m.dino_outputs(feature, outs)

  return init_params(model, rng, only=lambda name: is_extra((name,)), method=everything)
