"""PCSR as an online TTA method, in two recipes.

``recipe='sar'`` (the default, registered as ``pcsr``): the authors' recipe.
PCSR has no public code; its authors' three earlier ViT methods with code
(VCT, DCT, DPAL, all "built upon SAR's code") keep SAR's recipe and add their
modules on top, and PCSR's Table 3 "Baseline Method" scores exactly SAR's 63.6.
This follows DPAL (``dpal.py``, ``main.py``), whose loss is PCSR's eq. 9:

* Adapted: LayerNorm scale/bias of blocks 0-8 and, at ViT-L's 24 blocks, 12-20
  (lr 0.001 * B / 64, SAR's; DPAL used 0.01: ``lr_norm``) and the FGN (lr
  0.0005; ViT-L 0.0001) in SAM (rho 0.05) over SGD momentum 0.9; the DSN (lr
  0.2; ViT-L 0.05) in a separate plain SGD, momentum 0.9
  (``dsn_optimizer='sam'`` puts it inside SAM).
* Step (DPAL's order): first forward -> loss = reliable entropy (``ent < E0``)
  + lambda * similarity (eq. 9, lambda = n_reliable / B) -> backward -> DSN
  step -> SAM first step (LayerNorms and FGN perturbed by rho * g / ||g||,
  the norm over SAM's params) -> second forward at the perturbed weights with
  the updated DSN -> entropy only, re-filtered among the first mask -> SAM
  second step (weights restored, SGD step with the second gradient).
* Frozen LayerNorms (``skip_blocks``): DCT's and DPAL's ``collect_params``
  skip the modules whose names contain 'blocks.9', 'blocks.10', 'blocks.11',
  'blocks.21', 'blocks.22' or 'blocks.23' (and the final 'norm'): blocks 9-11
  of ViT-B, 9-11 and 21-23 of ViT-L (`base.AUTHORS_SKIP_BLOCKS`). SAR's own
  code skips 9-11 only, at every depth (`methods.sar`).
* Departure: eq. 9's lambda divides n_reliable by the batch's real image
  count; DPAL divides by its nominal ``args.test_batch_size`` on every batch,
  so on a ragged last batch (ImageNet-C's 50,000 images at 64: one batch of 16
  per corruption) its lambda is a quarter of ours. The paper's lambda is the
  batch's share of reliable samples, which ours is on every batch; full
  batches agree.
* Recovery: SAR's EMA of the second loss; below 0.2 the whole model state
  taken at construction comes back -- LayerNorms, DSN and FGN -- and each
  optimizer's ``load_state_dict``: the plain SGD's restores its (empty)
  momentum, SAM's does not reach its inner SGD, whose momentum survives
  (``reset_optimizer='all'`` clears it as well). The EMA is written back.
* Prediction: the first forward's (before the update), as SAR's and DCT's
  code; ``eval_order='after'`` re-runs the forward, ``'perturbed'`` reports
  the second forward's (DPAL's).

``recipe='frozen'`` (registered as ``pcsr-frozen``): the reading of the paper's
text alone. Only DSN and FGN adapt (``adapt_norms=True`` adds the backbone's
LayerNorms), plain SGD with the same learning rates and momentum 0.9 on eq. 9,
no reset unless ``reset=True``, prediction after the update (Algorithm 1).

The modules are on every layer (the paper's "each layer"); the recalibrators'
``config.skip_blocks=(9, 10, 11)`` gives DCT's blocks 0-8.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.methods.base import (AUTHORS_SKIP_BLOCKS, Method, Prepared, is_block_layernorm_param, is_layernorm_param,
                                   merge, split)
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import (RESET_OPTIMIZER, Recovery, group_sgd, parallel, recover, sam_perturb,
                                         sar_code_lr)
from pcsr_jax.models import pcsr
from pcsr_jax.models.vit import init_params

RECIPES = ("sar", "frozen")
GROUPS = ("norm", "fgn", "dsn")


def is_recalibrator_param(path) -> bool:
  return path[0].startswith("recal_")


def param_group(path) -> str:
  """'norm' (backbone LayerNorms), or the recalibrator's 'dsn' / 'fgn'."""
  return pcsr.param_group(path) if is_recalibrator_param(path) else "norm"


@dataclasses.dataclass(frozen=True)
class PCSR(Method):
  name: ClassVar[str] = "pcsr"
  cost: ClassVar[str] = "2F+2B"

  config: pcsr.PCSRConfig = pcsr.PCSRConfig()
  recipe: str = field("sar", RECIPES)
  # Learning rates of the three groups; 0 leaves a group as it is (an ablation).
  lr_dsn: float = field(0.2, ">= 0")
  lr_fgn: float = field(0.0005, ">= 0")
  lr_norm: Optional[float] = field(None, ">= 0")  # None: SAR's 0.001 * B / 64 (DPAL: 0.01)
  momentum: float = field(0.9, "[0, 1)")
  # scales eq. 9's lambda (1: the paper; 0: entropy only, an ablation)
  similarity_weight: float = field(1.0, ">= 0")
  # recipe "sar"
  rho: float = field(0.05, ">= 0")
  # LayerNorms of these blocks (and the final norm) stay frozen
  skip_blocks: tuple[int, ...] = field(AUTHORS_SKIP_BLOCKS, ">= 0")
  # "separate": DPAL's plain SGD on the first-pass loss; "sam": inside SAM
  dsn_optimizer: str = field("separate", ("separate", "sam"))
  reset_optimizer: str = field("official", RESET_OPTIMIZER)
  ema_decay: float = field(0.9, "[0, 1]")
  clear_ema_on_reset: bool = False
  # recipe "frozen"
  adapt_norms: bool = False  # also adapt every LayerNorm (lr_norm)
  reset: bool = False  # SAR-style recovery (plain SGD: its momentum is restored with the params)
  # both
  reset_constant: float = field(0.2, ">= 0")

  def __post_init__(self):
    if isinstance(self.config, dict):  # from JSON (--method-args)
      object.__setattr__(self, "config", pcsr.PCSRConfig.from_dict(self.config))
    super().__post_init__()

  @property
  def default_eval_order(self) -> str:  # type: ignore[override]
    return "before" if self.recipe == "sar" else "after"

  @property
  def eval_orders(self) -> tuple[str, ...]:  # type: ignore[override]
    return ("before", "after", "perturbed") if self.recipe == "sar" else ("before", "after")

  @staticmethod
  def preset(arch: str, **overrides) -> "PCSR":
    """The paper's learning rates: ViT-B/16 0.2 / 0.0005; ViT-L/16 0.05 / 0.0001 (DSN / FGN)."""
    return PCSR(**{**PCSR.lrs(arch), **overrides})

  @staticmethod
  def lrs(arch: str) -> dict:
    """DSN / FGN learning rates of the paper for ``arch`` (only ViT-L/16 differs from the defaults)."""
    return dict(lr_dsn=0.05, lr_fgn=0.0001) if arch.startswith("vit_large") else {}

  def is_trainable(self, path) -> bool:
    if is_recalibrator_param(path):
      return True
    if not is_layernorm_param(path):
      return False
    if self.recipe == "frozen":
      return self.adapt_norms
    return is_block_layernorm_param(path, self.skip_blocks)

  def in_sam(self, path) -> bool:
    return param_group(path) != "dsn" or self.dsn_optimizer == "sam"

  def prepare(self, model, params, rng, batch_size):
    adapted = model.clone(recalibration=self.config)
    full = dict(params)
    full.update(init_params(adapted, rng, only=lambda name: is_recalibrator_param((name,))))
    lrs = dict(norm=self.lr_norm if self.lr_norm is not None else sar_code_lr(batch_size), fgn=self.lr_fgn,
               dsn=self.lr_dsn)
    if self.recipe == "frozen":
      tx = group_sgd(lrs, self.momentum, param_group, GROUPS)
      return Prepared(adapted, full, is_trainable=self.is_trainable, tx=tx)
    sam_groups = GROUPS if self.dsn_optimizer == "sam" else ("norm", "fgn")
    parts = {"sam": group_sgd({g: lrs[g] for g in sam_groups}, self.momentum, param_group, GROUPS)}
    if self.dsn_optimizer == "separate":
      parts["sgd"] = group_sgd({"dsn": lrs["dsn"]}, self.momentum, param_group, GROUPS)
    return Prepared(adapted, full, is_trainable=self.is_trainable, tx=parallel(**parts), parts=parts)

  def init_extra(self, prep, trainable, opt_state):
    return Recovery.init(trainable, opt_state) if self.recipe == "sar" or self.reset else None

  def _loss(self, prep, frozen, trainable, images, valid, margin):
    """Eq. 9 on one forward: ``(loss, (logits, mask, entropy loss, similarity loss))``."""
    logits, sown = self.forward(prep, frozen, trainable, images, collect=("losses",))
    ent = losses.entropy(logits)
    mask = losses.reliable_mask(ent, margin, valid)
    l_ent = losses.masked_mean(ent, mask)
    sims = jax.tree.leaves(sown.get("losses", {}))  # one [B] per layer call
    l_sim = losses.similarity_loss(jnp.stack(sims), valid) if sims else jnp.zeros(())
    # Eq. 9's lambda: the share of reliable images among the real ones (DPAL: / its nominal batch size; doc).
    lam = self.similarity_weight * jnp.sum(mask) / jnp.maximum(jnp.sum(valid), 1)
    return l_ent + lam * l_sim, (logits, mask, l_ent, l_sim)

  def update(self, prep, frozen, state, images, valid):
    margin = self.margin(prep.model.config.num_classes)
    grad_fn = jax.value_and_grad(self._loss, argnums=2, has_aux=True)
    (loss, (logits, mask, l_ent, l_sim)), grads = grad_fn(prep, frozen, state.trainable, images, valid, margin)
    metrics = {"loss": loss, "entropy_loss": l_ent, "similarity_loss": l_sim, "num_reliable": jnp.sum(mask)}
    if self.recipe == "frozen":
      new = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
      if self.reset:
        new, metrics["reset"] = recover(state, new, l_ent, jnp.any(mask), self.ema_decay, self.reset_constant)
      return new, logits, metrics

    # 1. The DSN's plain SGD steps on the first-pass loss (DPAL: ad_optimizer.step()).
    trainable, opt_state = state.trainable, dict(state.opt_state)
    if "sgd" in prep.parts:
      trainable, opt_state["sgd"] = _step(prep.parts["sgd"], grads, opt_state["sgd"], trainable)
    # 2. SAM's first step on its params, with the first-pass gradient (similarity term included).
    perturbed = sam_perturb(trainable, grads, self.rho, include=self.in_sam)

    # 3. Second forward at the perturbed weights: entropy only, re-filtered among the first mask.
    other, sam_params = split(perturbed, self.in_sam)

    def second(sam_params):
      logits2, _ = self.forward(prep, frozen, merge(other, sam_params), images)
      ent2 = losses.entropy(logits2)
      mask2 = losses.reliable_mask(ent2, margin, mask)
      return losses.masked_mean(ent2, mask2), (logits2, mask2)

    (loss2, (logits2, mask2)), g2 = jax.value_and_grad(second, has_aux=True)(sam_params)
    # 4. SAM's second step: back to the unperturbed weights, SGD step with the second gradient.
    g2 = merge(jax.tree.map(jnp.zeros_like, other), g2)
    trainable, opt_state["sam"] = _step(prep.parts["sam"], g2, opt_state["sam"], trainable)
    new = state.replace(trainable=trainable, opt_state=opt_state, step=state.step + 1)
    # 5. Recovery: params and the plain SGD's state from the source; SAM's inner momentum survives.
    on_reset = dict(new.opt_state, **{k: v for k, v in state.extra.source[1].items() if k != "sam"})
    new, reset = recover(state, new, loss2, jnp.any(mask2), self.ema_decay, self.reset_constant,
                         self.clear_ema_on_reset, opt_on_reset=on_reset if self.reset_optimizer == "official" else None)
    metrics.update(loss2=loss2, num_reliable2=jnp.sum(mask2), ema=new.extra.ema, reset=reset,
                   perturbed_logits=logits2)
    return new, logits, metrics


def _step(tx: optax.GradientTransformation, grads, opt_state, params):
  """One optimizer's step: ``(params, opt_state)``."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state
