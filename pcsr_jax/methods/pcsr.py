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

from pcsr_jax import losses
from pcsr_jax.methods.base import AUTHORS_SKIP_BLOCKS, Method, Prepared, is_block_layernorm_param, is_layernorm_param
from pcsr_jax.methods.dpal import authors_step
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import RESET_OPTIMIZER, Recovery, group_sgd, parallel, recover, sar_code_lr
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

    def first(trainable):
      loss, (logits, mask, l_ent, l_sim) = self._loss(prep, frozen, trainable, images, valid, margin)
      return loss, (logits, mask, {"entropy_loss": l_ent, "similarity_loss": l_sim})

    if self.recipe == "sar":  # DPAL's step
      return authors_step(self, prep, frozen, state, images, valid, first, self.in_sam, margin)
    (loss, (logits, mask, metrics)), grads = jax.value_and_grad(first, has_aux=True)(state.trainable)
    metrics = dict(metrics, loss=loss, num_reliable=jnp.sum(mask))
    new = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    if self.reset:
      new, metrics["reset"] = recover(state, new, metrics["entropy_loss"], jnp.any(mask), self.ema_decay,
                                      self.reset_constant)
    return new, logits, metrics
