"""TENT (Wang et al., ICLR 2021) for ViTs, as run in SAR's code.

All LayerNorm affine params (every block's norm1/norm2 and the final norm),
SGD(lr = 0.001 * B / 64, momentum 0.9), loss = mean entropy over the whole
batch, no reset. The reported prediction is the loss forward's (before the update).

``loss='come'`` (registry name ``tent-come``) is COME's Tent (``BlueWhaleLab/COME:tent_come.py``): the entropy
replaced by `losses.come_entropy`, everything else the same. COME's own runs normalize with ImageNet's mean
and std; here, as for every row, the checkpoint's normalization.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax

from pcsr_jax import losses
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import sar_code_lr, sgd


@dataclasses.dataclass(frozen=True)
class Tent(Method):
  name: ClassVar[str] = "tent"
  lr: Optional[float] = field(None, "> 0")  # None: 0.001 * B / 64
  momentum: float = field(0.9, "[0, 1)")
  loss: str = field("entropy", losses.LOSSES)  # 'come': COME's entropy over K+1 entries

  def prepare(self, model, params, rng, batch_size):
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size)
    return Prepared(model, params, is_trainable=is_layernorm_param, tx=sgd(lr, self.momentum))

  def update(self, prep, frozen, state, images, valid):
    def loss_fn(trainable):
      logits, _ = self.forward(prep, frozen, trainable, images)
      ent = losses.adaptation_entropy(logits, self.loss)
      return losses.masked_mean(ent, valid), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
    state = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    return state, logits, {"loss": loss}
