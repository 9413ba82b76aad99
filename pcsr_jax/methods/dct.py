"""DCT (Tang et al.), as in ``yushuntang/DCT`` (``dct.py``, ``main.py``, ``models/dct_attention.py``, ``sam.py``):
one of PCSR's authors' earlier methods, on SAR's code base.

* Model: in blocks 0-8 (ViT-B, ``main.py`` 299-305) or 0-20 (ViT-L's 24 blocks, ``main.py`` 306-312) the
  attention gets one more token whose q, k and v a ``Linear(D, 3D)`` generator makes
  from the block's normed class token (`pcsr_jax.models.dct`: appended last, its output row dropped). The code
  builds the generators with PyTorch's default random init and reloads only the timm weights, so the model
  before any update is not the source model; here the generators are drawn from the run's seed (the engine's
  ``init_rng``), the same init distribution.
* Adapted, in one SAM (rho 0.05) over SGD with momentum 0.9: the LayerNorms and generators of the blocks that
  ``dct.py``'s name test (``collect_params``) keeps, every block but 9-11 and 21-23 (`base.AUTHORS_SKIP_BLOCKS`):
  the LayerNorms at 0.001 * B / 64 (not doubled at batch size 1: ``main.py`` doubles SAR's only) and the
  generators at 0.01 (0.003 for ImageNet-R in the code: ``lr_generator``). At ViT-B's depth that is blocks 0-8's
  LayerNorms and generators (36 tensors); at ViT-L's, the generators of blocks 9-11 run but stay at their random
  init, and blocks 0-8 and 12-20 adapt (108 tensors). ``--LN_lr`` is unused by the code.
* Step: exactly SAR's (`SAR.update`: entropy filter, SAM's two passes, the EMA of the second loss, the 0.2
  reset that reloads the model, generators included, and SAM's state dict while the inner momentum survives);
  the prediction is the first forward's, before the update (2F + 2B).

Departures and choices: the code has those two depths only; at any other depth the default is ViT-B's blocks 0-8
(``blocks`` sets others, and a generator in ``skip_blocks`` stays frozen as the name test has it). The paper says
every layer and a prediction after the update (Fig. 3); the code, which
this follows, adapts blocks 0-8 and predicts before. The code's reset test is the literal ``ema < 0.2`` (its
``reset_constant_em`` is never read): ``reset_constant`` is that literal. The code normalizes with 0.5 / 0.5 (its
augreg checkpoints'); here the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional

from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import AUTHORS_SKIP_BLOCKS, Prepared, is_block_layernorm_param
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import group_sgd, sar_code_lr
from pcsr_jax.methods.sar import SAR
from pcsr_jax.models.dct import DCTConfig, generator_index, is_generator_param
from pcsr_jax.models.vit import init_params

GROUPS = ("norm", "generator")
VIT_B_BLOCKS, VIT_L_BLOCKS = 9, 21  # main.py: net.blocks[:9] of vitbase_timm, net.blocks[:21] of vitlarge_timm


def param_group(path) -> str:
  return "generator" if is_generator_param(path) else "norm"


@dataclasses.dataclass(frozen=True)
class DCT(SAR):
  name: ClassVar[str] = "dct"
  lr: Optional[float] = field(None, "> 0")  # the LayerNorms': None is 0.001 * B / 64 (no doubling at B = 1)
  lr_generator: float = field(0.01, ">= 0")
  # the blocks with a generated token; None: main.py's, 0-20 at ViT-L's depth 24, else 0-8 (those the model has)
  blocks: Optional[tuple[int, ...]] = field(None, ">= 0")
  # dct.py's name test: the LayerNorms and generators of blocks 9-11 and 21-23 stay frozen
  skip_blocks: tuple[int, ...] = field(AUTHORS_SKIP_BLOCKS, ">= 0")

  def generated_blocks(self, depth: int) -> tuple[int, ...]:
    if self.blocks is None:
      return tuple(range(VIT_L_BLOCKS if depth == 24 else min(VIT_B_BLOCKS, depth)))
    if not self.blocks or len(set(self.blocks)) != len(self.blocks) or max(self.blocks) >= depth:
      raise UserError(f"dct blocks: expected distinct block indices below the model's {depth}, got {self.blocks}")
    return tuple(sorted(self.blocks))

  def trainable(self, path, generated: tuple[int, ...]) -> bool:
    """``dct.py``'s name test on our paths: ``qkv_gen_j`` is the generator of block ``generated[j]``."""
    if is_generator_param(path):
      return generated[generator_index(path)] not in self.skip_blocks
    return is_block_layernorm_param(path, self.skip_blocks)

  def prepare(self, model, params, rng, batch_size):
    generated = self.generated_blocks(model.config.depth)
    adapted = model.clone(qkv_tokens=DCTConfig(generated))
    full = dict(params)
    full.update(init_params(adapted, rng, only=lambda name: is_generator_param((name,))))
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size)
    tx = group_sgd({"norm": lr, "generator": self.lr_generator}, self.momentum, param_group, GROUPS)
    return Prepared(adapted, full, is_trainable=functools.partial(self.trainable, generated=generated), tx=tx)
