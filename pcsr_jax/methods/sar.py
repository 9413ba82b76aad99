"""SAR (Niu et al., ICLR 2023), as in its official code (``sar.py``, ``sam.py``, ``main.py``).

* Adapted: weight and bias of norm1 and norm2 in every block except blocks 9,
  10 and 11 (the code skips modules whose name contains 'blocks.9',
  'blocks.10', 'blocks.11' and the final 'norm'). That string test hits
  blocks 9-11 only at any depth below 90 ('blocks.9' is no substring of
  'blocks.19'), so ViT-L adapts blocks 0-8 and 12-23 (`base.SAR_SKIP_BLOCKS`).
  This is SAR's own code; the copies of ``sar.py`` in the PCSR authors' DCT and
  DPAL repositories also skip 'blocks.21'-'blocks.23', as their methods do
  (`methods.pcsr`, `base.AUTHORS_SKIP_BLOCKS`): ``skip_blocks`` gives theirs.
* Optimizer: SAM (rho 0.05, not adaptive) over SGD(lr = 0.001 * B / 64,
  momentum 0.9); the lr is doubled at batch size 1 (SAR's ``main.py``; not for
  ``sar-come``, below).
* Step: entropy -> mask ``ent < E0`` (strict) -> mean over the mask -> grad ->
  perturb by ``rho * g / (||g|| + 1e-12)`` (global norm) -> forward at the
  perturbed weights, keep the first mask's samples, mask again ``ent2 < E0`` ->
  mean -> grad -> restore the weights and take the SGD step with that gradient.
* Recovery: ``ema = 0.9 * ema + 0.1 * loss2`` (the first value initializes it;
  batches with an empty second mask leave it alone); if ``ema < 0.2`` the code
  calls ``model.load_state_dict`` and ``optimizer.load_state_dict`` with the
  copies taken at construction. That restores the adapted params, but *not*
  the SGD momentum: ``SAM`` keeps the momentum buffers in its inner
  ``base_optimizer``, and SAM's own ``state_dict`` (the one saved and loaded)
  holds only its ``old_p`` copies. So the momentum survives every reset
  (``reset_optimizer='official'``); ``'all'`` clears it too. The caller then
  writes the pre-reset EMA back (``self.reset(); self.ema = ema``), so the EMA
  is *not* cleared either; ``clear_ema_on_reset=True`` gives the paper's
  description instead.
* The reported prediction is the first forward's (before the update);
  ``eval_order='perturbed'`` reports the second forward's.

``loss='come'`` (registry name ``sar-come``) is COME's SAR (``BlueWhaleLab/COME:sar_come.py``): both passes'
entropies (their masks against E0, the losses, the EMA and its 0.2 reset) are `losses.come_entropy`'s; the
checkpoint's normalization, where COME's runs take ImageNet's. Its default lr is COME's ``main.py``'s
(``0.001 / 64 * bs`` for ``vitbase_timm``, every method), never doubled: SAR's own ``main.py`` doubles it at batch
size 1, COME's does not.

An empty mask gives a zero gradient (PyTorch: NaN loss, zero grads); the SGD
step still runs, so momentum moves the params as it does in PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from pcsr_jax import losses
from pcsr_jax.methods.base import SAR_SKIP_BLOCKS, Method, Prepared, is_block_layernorm_param
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import RESET_OPTIMIZER, Recovery, recover, sam_perturb, sar_code_lr, sgd


@dataclasses.dataclass(frozen=True)
class SAR(Method):
  name: ClassVar[str] = "sar"
  cost: ClassVar[str] = "2F+2B"
  eval_orders: ClassVar[tuple[str, ...]] = ("before", "after", "perturbed")
  lr: Optional[float] = field(None, "> 0")  # None: 0.001 * B / 64, doubled at B = 1 but with loss='come'
  momentum: float = field(0.9, "[0, 1)")
  rho: float = field(0.05, ">= 0")  # SAM's assert rho >= 0
  reset_constant: float = field(0.2, ">= 0")  # 0: never resets (an entropy EMA is never below 0)
  ema_decay: float = field(0.9, "[0, 1]")
  skip_blocks: tuple[int, ...] = field(SAR_SKIP_BLOCKS, ">= 0")
  clear_ema_on_reset: bool = False
  # "official": SAM's inner momentum survives a reset; "all": cleared too
  reset_optimizer: str = field("official", RESET_OPTIMIZER)
  loss: str = field("entropy", losses.LOSSES)  # 'come': COME's entropy over K+1 entries

  def trainable(self, path) -> bool:
    return is_block_layernorm_param(path, self.skip_blocks)

  def prepare(self, model, params, rng, batch_size):
    doubled = batch_size == 1 and self.loss != "come"  # SAR's main.py doubles it at B = 1; COME's does not
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size) * (2 if doubled else 1)
    return Prepared(model, params, is_trainable=self.trainable, tx=sgd(lr, self.momentum))

  def init_extra(self, prep, trainable, opt_state):
    return Recovery.init(trainable, opt_state)

  def update(self, prep, frozen, state, images, valid):
    margin = self.margin(prep.model.config.num_classes)

    def first(trainable):
      logits, _ = self.forward(prep, frozen, trainable, images)
      ent = losses.adaptation_entropy(logits, self.loss)
      mask1 = losses.reliable_mask(ent, margin, valid)
      return losses.masked_mean(ent, mask1), (logits, mask1)

    (loss1, (logits, mask1)), g1 = jax.value_and_grad(first, has_aux=True)(state.trainable)
    perturbed = sam_perturb(state.trainable, g1, self.rho)

    def second(trainable):
      logits2, _ = self.forward(prep, frozen, trainable, images)
      ent2 = losses.adaptation_entropy(logits2, self.loss)
      mask2 = losses.reliable_mask(ent2, margin, mask1)  # re-filter among the first pass's samples
      return losses.masked_mean(ent2, mask2), (logits2, mask2)

    (loss2, (logits2, mask2)), g2 = jax.value_and_grad(second, has_aux=True)(perturbed)
    new = self.apply_gradients(prep, state, g2)  # SGD step at the original (unperturbed) params

    # PyTorch: loss_second is NaN (and the EMA not updated) iff the second mask is empty.
    state, reset = recover(state, new.replace(step=state.step + 1), loss2, jnp.any(mask2), self.ema_decay,
                           self.reset_constant, self.clear_ema_on_reset,
                           opt_on_reset=new.opt_state if self.reset_optimizer == "official" else None)
    metrics = {"loss": loss1, "loss2": loss2, "num_reliable": jnp.sum(mask1), "num_reliable2": jnp.sum(mask2),
               "ema": state.extra.ema, "reset": reset, "perturbed_logits": logits2}
    return state, logits, metrics
