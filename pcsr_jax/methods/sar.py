"""SAR (Niu et al., ICLR 2023), as in its official code.

* Adapted: weight and bias of norm1 and norm2 in every block except blocks 9,
  10 and 11 (the code skips modules whose name contains 'blocks.9',
  'blocks.10', 'blocks.11' and the final 'norm').
* Optimizer: SAM (rho 0.05, not adaptive) over SGD(lr = 0.001 * B / 64,
  momentum 0.9); the lr is doubled at batch size 1.
* Step: entropy -> mask ``ent < E0`` (strict) -> mean over the mask -> grad ->
  perturb by ``rho * g / (||g|| + 1e-12)`` (global norm) -> forward at the
  perturbed weights, keep the first mask's samples, mask again ``ent2 < E0`` ->
  mean -> grad -> restore the weights and take the SGD step with that gradient.
* Recovery: ``ema = 0.9 * ema + 0.1 * loss2`` (the first value initializes it;
  batches with an empty second mask leave it alone); if ``ema < 0.2`` the
  adapted params and the optimizer state are restored to their initial values.
  In the official code the caller then writes the pre-reset EMA back
  (``self.reset(); self.ema = ema``), so the EMA is *not* cleared;
  ``clear_ema_on_reset=True`` gives the paper's description instead.
* The reported prediction is the first forward's (before the update).

An empty mask gives a zero gradient (PyTorch: NaN loss, zero grads); the SGD
step still runs, so momentum moves the params as it does in PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from pcsr_jax import losses
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param, recover, sgd
from pcsr_jax.methods.tent import sar_code_lr


@dataclasses.dataclass(frozen=True)
class SAR(Method):
  name: ClassVar[str] = "sar"
  lr: Optional[float] = None  # None: 0.001 * B / 64, doubled at B = 1
  momentum: float = 0.9
  rho: float = 0.05
  reset_constant: float = 0.2
  ema_decay: float = 0.9
  skip_blocks: tuple[int, ...] = (9, 10, 11)
  clear_ema_on_reset: bool = False

  def trainable(self, path) -> bool:
    if not is_layernorm_param(path) or path[0] == "norm":
      return False
    return not (path[0].startswith("blocks_") and int(path[0].split("_")[1]) in self.skip_blocks)

  def prepare(self, model, params, rng, batch_size):
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size) * (2 if batch_size == 1 else 1)
    return Prepared(model, params, is_trainable=self.trainable, tx=sgd(lr, self.momentum), keeps_source=True)

  def update(self, prep, frozen, state, images, valid):
    margin = self.margin(prep.model.config.num_classes)

    def first(trainable):
      logits, _ = self.forward(prep, frozen, trainable, images)
      ent = losses.entropy(logits)
      mask1 = losses.reliable_mask(ent, margin, valid)
      return losses.masked_mean(ent, mask1), (logits, mask1)

    (loss1, (logits, mask1)), g1 = jax.value_and_grad(first, has_aux=True)(state.trainable)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(g1)))  # global L2 norm
    scale = self.rho / (grad_norm + 1e-12)
    perturbed = jax.tree.map(lambda p, g: p + g * scale, state.trainable, g1)

    def second(trainable):
      logits2, _ = self.forward(prep, frozen, trainable, images)
      ent2 = losses.entropy(logits2)
      mask2 = losses.reliable_mask(ent2, margin, mask1)  # re-filter among the first pass's samples
      return losses.masked_mean(ent2, mask2), mask2

    (loss2, mask2), g2 = jax.value_and_grad(second, has_aux=True)(perturbed)
    new = self.apply_gradients(prep, state, g2)  # SGD step at the original (unperturbed) params

    # PyTorch: loss_second is NaN (and the EMA not updated) iff the second mask is empty.
    state, reset = recover(state, new.replace(step=state.step + 1), loss2, jnp.any(mask2), self.ema_decay,
                           self.reset_constant, self.clear_ema_on_reset)
    metrics = {"loss": loss1, "loss2": loss2, "num_reliable": jnp.sum(mask1), "num_reliable2": jnp.sum(mask2),
               "ema": state.ema, "reset": reset}
    return state, logits, metrics
