"""DPAL (Tang et al.), as in ``yushuntang/DPAL`` (``dpal.py``, ``main.py``, ``models/dpal_transformer.py``,
``sam.py``): the newest of PCSR's authors' earlier methods, and the step `pcsr`'s recipe runs (`authors_step`).

* Model (`pcsr_jax.models.dpal`): a shallow prompt before the class token, deep prompts replacing it before
  blocks 1 .. depth-1, and one zero-initialised predictor per block whose output (the *noise*) the class token
  loses after that block; the head reads the class token.
* Adapted: the LayerNorms of blocks 0-8 (``dpal.py``'s name test, blocks 21-23 also skipped at 24 blocks:
  `base.AUTHORS_SKIP_BLOCKS`) and both prompt tensors in SAM (rho 0.05) over SGD momentum 0.9, lr 0.01 each
  (``norm_lr``, ``prompt_lr``; not scaled with the batch); the predictors in a separate plain SGD, momentum 0.9,
  lr 0.01 (``predictor_lr``).
* Step (``dpal.py:98-140``): forward 1; loss 1 = the mean entropy of the samples below E0 + (n_reliable / B) x
  sim, where sim is the layers' mean of minus the mean of the B x B cosine matrix of the noise (the diagonal
  included) and B the configured batch size (``args.test_batch_size``: a short last batch keeps it); the
  predictors' SGD step with its gradient; SAM's first step on the LayerNorms and prompts; forward 2 at the
  perturbed weights with the updated predictors, entropy re-filtered among forward 1's samples; SAM's second
  step. The prediction is forward 2's, at the perturbed weights (``eval_order='perturbed'``, the default).
* Recovery: SAR's EMA of the second loss; below 0.2 (a literal in the code: ``reset_constant``) the whole
  prompted model as built comes back -- LayerNorms, prompts, predictors -- with the predictors' SGD state
  (empty), while SAM's inner momentum survives (its ``state_dict`` does not hold it) and the EMA is written back.

The similarity term (checked by ``tests/test_dpal.py``): under the zero init a predictor's output is
``GELU(fc2.bias)`` for every sample, so sim is 0 until ``fc2.bias`` moves and -1 from then on (all rows equal),
and its gradient is zero (float rounding, ~1e-6, once the rows are equal): the term changes the loss's value,
never the update. The paper calls the two paths adversarial; the code has no sign flip (both minimize).

Departures and choices: the code normalizes with 0.5 / 0.5 (its augreg checkpoints'); here the checkpoint's.
Padded rows (a batch padded to the devices) are out of the entropies and of the cosine means.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.methods.base import AUTHORS_SKIP_BLOCKS, Method, Prepared, is_block_layernorm_param, merge, split
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import RESET_OPTIMIZER, Recovery, group_sgd, parallel, recover, sam_perturb
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.methods.state import AdaptState
from pcsr_jax.models import dpal

Array = jax.Array
GROUPS = ("norm", "prompt", "predictor")


def param_group(path) -> str:
  if path[0] in (dpal.PROMPT, dpal.DEEP):
    return "prompt"
  return "predictor" if path[0].startswith(dpal.PRED) else "norm"


def noise_similarity(noises: Array, valid: Array) -> Array:
  """``dpal.py:109``: the layers' mean of minus the mean of every pairwise cosine (diagonal included) of the
  ``[B, L, D]`` noise, over the valid rows. As torch 2's ``F.cosine_similarity``: each row divided by its own
  norm clamped at eps 1e-8, then the dot products. A zero row (the noise at DPAL's init) has cosine 0 with
  everything and a zero gradient (the norm is never differentiated at 0). Clamping the *product* of the squared
  norms instead (torch 1's form) would, for the tiny noise of the late layers (|x| ~ 1e-5), scale the cosines
  and their gradients by up to 1e8."""
  norm = jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(noises), axis=-1, keepdims=True), 1e-30))
  unit = jnp.swapaxes(noises / jnp.maximum(norm, 1e-8), 0, 1)  # [L, B, D]: a product per layer, across rows
  cos = jnp.einsum("lid,ljd->lij", unit, unit)
  pairs = (valid[:, None] & valid[None, :]).astype(cos.dtype)
  return -jnp.mean(jnp.sum(cos * pairs, axis=(1, 2)) / jnp.maximum(jnp.sum(pairs), 1.0))


def authors_step(method: Method, prep: Prepared, frozen: Any, state: AdaptState, images: Array, valid: Array,
                 first: Callable[[Any], tuple[Array, tuple[Array, Array, dict]]], in_sam: Callable,
                 margin: float) -> tuple[AdaptState, Array, dict]:
  """DPAL's step (``dpal.py:98-140``), shared with `pcsr`'s recipe: ``first(trainable)`` is the first pass's
  ``(loss, (logits, mask, metrics))``; ``prep.parts`` holds ``"sam"`` (the params ``in_sam`` marks) and, if
  any param is outside SAM, ``"sgd"``, the plain SGD that steps first on the first pass's gradient. ``method``
  brings rho, the EMA's decay and threshold and how a reset treats the optimizers."""
  (loss, (logits, mask, metrics)), grads = jax.value_and_grad(first, has_aux=True)(state.trainable)
  metrics = dict(metrics, loss=loss, num_reliable=jnp.sum(mask))
  # 1. The plain SGD steps on the first-pass loss (DPAL: ad_optimizer.step()).
  trainable, opt_state = state.trainable, dict(state.opt_state)
  if "sgd" in prep.parts:
    trainable, opt_state["sgd"] = _step(prep.parts["sgd"], grads, opt_state["sgd"], trainable)
  # 2. SAM's first step on its params, with the first-pass gradient (similarity term included).
  perturbed = sam_perturb(trainable, grads, method.rho, include=in_sam)

  # 3. Second forward at the perturbed weights: entropy only, re-filtered among the first mask.
  other, sam_params = split(perturbed, in_sam)

  def second(sam_params):
    logits2, _ = method.forward(prep, frozen, merge(other, sam_params), images)
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
  new, reset = recover(state, new, loss2, jnp.any(mask2), method.ema_decay, method.reset_constant,
                       method.clear_ema_on_reset,
                       opt_on_reset=on_reset if method.reset_optimizer == "official" else None)
  metrics.update(loss2=loss2, num_reliable2=jnp.sum(mask2), ema=new.extra.ema, reset=reset,
                 perturbed_logits=logits2)
  return new, logits, metrics


def _step(tx: optax.GradientTransformation, grads, opt_state, params):
  """One optimizer's step: ``(params, opt_state)``."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@dataclasses.dataclass(frozen=True)
class DPAL(Method):
  name: ClassVar[str] = "dpal"
  cost: ClassVar[str] = "2F+2B"
  default_eval_order: ClassVar[str] = "perturbed"
  eval_orders: ClassVar[tuple[str, ...]] = ("before", "after", "perturbed")
  lr_norm: float = field(0.01, ">= 0")
  lr_prompt: float = field(0.01, ">= 0")
  lr_predictor: float = field(0.01, ">= 0")
  momentum: float = field(0.9, "[0, 1)")
  rho: float = field(0.05, ">= 0")
  similarity_weight: float = field(1.0, ">= 0")  # scales (n_reliable / B) x sim (0: entropy only)
  skip_blocks: tuple[int, ...] = field(AUTHORS_SKIP_BLOCKS, ">= 0")
  reset_constant: float = field(0.2, ">= 0")
  ema_decay: float = field(0.9, "[0, 1]")
  clear_ema_on_reset: bool = False
  reset_optimizer: str = field("official", RESET_OPTIMIZER)

  def is_trainable(self, path) -> bool:
    return dpal.is_extra(path) or is_block_layernorm_param(path, self.skip_blocks)

  @staticmethod
  def in_sam(path) -> bool:
    return param_group(path) != "predictor"

  def prepare(self, model, params, rng, batch_size):
    adapted = dpal.create(model)
    full = dict(params)
    full.update(dpal.init_extra(adapted, rng))
    parts = {"sam": group_sgd({"norm": self.lr_norm, "prompt": self.lr_prompt}, self.momentum, param_group, GROUPS),
             "sgd": group_sgd({"predictor": self.lr_predictor}, self.momentum, param_group, GROUPS)}
    return Prepared(adapted, full, is_trainable=self.is_trainable, tx=parallel(**parts), parts=parts)

  def init_extra(self, prep, trainable, opt_state):
    return Recovery.init(trainable, opt_state)

  def update(self, prep, frozen, state, images, valid):
    margin = self.margin(prep.model.config.num_classes)

    def first(trainable):
      params = merge(frozen, trainable)
      logits, noises = in_row_passes(prep, lambda x: prep.model.apply({"params": params}, x, noises=True), images)
      ent = losses.entropy(logits)
      mask = losses.reliable_mask(ent, margin, valid)
      sim = noise_similarity(noises, valid)
      lam = self.similarity_weight * jnp.sum(mask) / valid.shape[0]  # / args.test_batch_size
      return losses.masked_mean(ent, mask) + lam * sim, (logits, mask, {"similarity_loss": sim})

    return authors_step(self, prep, frozen, state, images, valid, first, self.in_sam, margin)
