"""VCT (Tang et al., visual conditioning tokens), as in ``yushuntang/VCT`` (``vct.py``, ``main.py``, ``sam.py``,
``models/vision_transformer.py``): one of PCSR's authors' earlier methods, on SAR's code base.

* Tokens: the pretrained class token and a zero-initialised *instance token* ``[B, 1, D]``, one row per batch
  slot, added to the class token before the position embedding (``cls + instance_token[:n]``; the model's
  ``cls_offset``).
* Adapted, in one SAM (rho 0.05) over SGD with momentum 0.9 and one lr per group: the class token at 0.005,
  the instance token at 0.01 and the LayerNorms of blocks 0-8 (SAR's ``blocks.9``-``blocks.11`` name test) at
  0.001 * B / 64, this last one doubled at batch size 1 (the code's ``bs1`` setting). SAM's gradient norm spans
  every group, the tokens included.
* Per batch, SAR's step (entropy filter E0 = 0.4 ln C, SAM's two passes with the second pass re-filtered among
  the first's samples, the EMA of the second loss and its reset at 0.2), then a third forward with the
  updated (or reset) params: the reported prediction (``eval_order='after'``, the default; 3F + 2B). Then the
  instance token is zeroed, while its momentum buffer is kept: each batch's token is ``-lr (0.9 buf + g)``.
* A reset reloads the model and SAM's state dict copied at construction: the class token, the (zero) instance
  token and the LayerNorms go back, the inner SGD's momentum survives (SAM's state dict does not hold it) and
  the EMA is written back (``vct.py:47-49``), as in `SAR`.

Departures: the code's reset test is the literal ``ema < 0.2`` (its ``reset_constant_em`` is never read):
``reset_constant`` is that literal. The code normalizes with ImageNet's mean and std; here, as for every row, the
checkpoint's. A batch larger than the instance token's rows (a batch padded to the devices) uses zero rows for
the padding, which no loss sees.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from pcsr_jax.methods.base import Prepared, is_block_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import group_sgd, sar_code_lr
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.methods.sar import SAR

Array = jax.Array

INSTANCE = "vct_instance_token"  # {"token": [B, 1, D]}
GROUPS = ("norm", "cls", "instance")


def param_group(path) -> str:
  return {INSTANCE: "instance", "cls_token": "cls"}.get(path[0], "norm")


@dataclasses.dataclass(frozen=True)
class VCT(SAR):
  """SAR's step (`SAR.update`) on the model with the instance token, then the third forward and the zeroing."""

  name: ClassVar[str] = "vct"
  cost: ClassVar[str] = "3F+2B"
  default_eval_order: ClassVar[str] = "after"
  lr: Optional[float] = field(None, "> 0")  # the LayerNorms': None is 0.001 * B / 64, doubled at B = 1
  lr_cls: float = field(0.005, ">= 0")
  lr_token: float = field(0.01, ">= 0")

  def trainable(self, path) -> bool:
    return path[0] in (INSTANCE, "cls_token") or is_block_layernorm_param(path, self.skip_blocks)

  def prepare(self, model, params, rng, batch_size):
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size) * (2 if batch_size == 1 else 1)
    full = dict(params)
    full[INSTANCE] = {"token": jnp.zeros((batch_size, 1, model.config.embed_dim), jnp.float32)}
    tx = group_sgd({"norm": lr, "cls": self.lr_cls, "instance": self.lr_token}, self.momentum, param_group, GROUPS)
    return Prepared(model, full, is_trainable=self.trainable, tx=tx)

  @staticmethod
  def forward(prep, frozen, trainable, images, collect=()):
    """Logits with the instance token (its first rows; zero rows past them) on the class token."""
    params = merge(frozen, trainable)
    token = params.pop(INSTANCE)["token"]
    n = images.shape[0]
    token = jnp.pad(token, ((0, max(0, n - token.shape[0])), (0, 0), (0, 0)))[:n]
    apply = lambda xs: prep.model.apply({"params": params}, xs[0], cls_offset=xs[1])
    return in_row_passes(prep, apply, (images, token)), {}

  def update(self, prep, frozen, state, images, valid):
    state, logits, metrics = super().update(prep, frozen, state, images, valid)
    after, _ = self.forward(prep, frozen, state.trainable, images)  # vct.py:50, the reported prediction
    trainable = dict(state.trainable)
    trainable[INSTANCE] = {"token": jnp.zeros_like(trainable[INSTANCE]["token"])}  # its momentum stays
    return state.replace(trainable=trainable), logits, dict(metrics, after_logits=after)
