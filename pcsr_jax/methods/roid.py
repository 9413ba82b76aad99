"""ROID (Marsden, Döbler, Yang, WACV 2024): universal TTA by weighted soft-likelihood-ratio self-training.

As in its official code, DT ``mariodoebler/test-time-adaptation``: ``classification/methods/roid.py``,
``utils/losses.py`` (``SoftLikelihoodRatio``, ``SymmetricCrossEntropy``), ``utils/misc.py``
(``ema_update_model``), ``augmentations/transforms_cotta.py``, ``conf.py`` (ROID block) and
``cfgs/imagenet_c/roid.yaml``:

* Adapted: the affine params of every LayerNorm (all blocks' norm1/norm2 and the final norm).
* Optimizer: SGD lr 2.5e-4, momentum 0.9, Nesterov (DT's ``OPTIM.NESTEROV`` default), dampening 0,
  wd 0. DT does not scale the learning rate with the batch size (its ImageNet-C config uses 64): nor do we.
* Loss forward ``outputs = model(x)``. Sample weights, without gradient: ``w_div = 1 - cos(p_i, p_ema)``
  and ``w_cert = -entropy_i``, each min-max normalised within the batch; samples with ``w_div <
  mean(w_div)`` are masked out; ``weight = exp(w_div * w_cert / T)``, T = 1/3. ``p_ema`` starts uniform
  and moves with momentum 0.9 towards the mean softmax of the whole batch.
* Loss = ( sum_kept weight * SLR(outputs) + sum_kept weight * SCE(model(aug(x)), outputs) ) / B, where
  SLR is the soft likelihood ratio ``-sum_c p_c log(p_c / (1 - p_c) + 1e-5)`` with p clamped to 0.99,
  SCE the 0.5/0.5 symmetric cross-entropy (the original logits are NOT detached: the gradient flows
  through both forwards), and B the configured batch size (``cfg.TEST.BATCH_SIZE``: also for a
  ragged last batch, whose padding rows here carry no weight).
* Augmentation: CoTTA's pipeline without blur and noise, reflect padding (`pcsr_jax.augment.roid_augment`).
  The official applies it to the batch tensor of kept samples, so ONE draw is shared by the batch, as
  here. We augment the whole batch (fixed shapes) and forward the kept rows' views only (in chunks,
  `ROIDBase.consistency`): the same views, as every op but the draw is per image.
* After the SGD step every trainable param becomes ``0.99 * param + 0.01 * source`` (`ROID.merge`;
  CMF replaces this with its filter, `pcsr_jax.methods.cmf`).
* Prediction: the loss forward's logits (before the update), prior-corrected: ``prior`` = batch mean
  softmax, ``smooth = max(1/n, 1/C) / max(prior)``, ``smoothed = (prior + smooth) / (1 + smooth C)``,
  and the code multiplies the LOGITS (not the probabilities) by ``smoothed``; replicated. ``n`` is the
  number of valid rows (``outputs.shape[0]`` of the official's ragged batch).

``eval_orders = ("before",)``: the engine's "after" forward would skip the prior correction, which needs
the batch's valid rows. The images arrive normalised; the augmentation works on [0, 1] pixels, so the
method un-normalises with its ``mean``/``std`` fields (default 0.5, the augreg ViTs').
Padding rows are left out of every min/max/mean, of ``p_ema`` and of the loss.

Deviation: where a batch's ``w_div`` (or ``w_cert``) are all equal (e.g. a single valid sample), the
official's min-max normalisation divides 0 by 0 and the NaN loss poisons the model; here that
normalised weight is 0 instead (the sample is kept with weight ``exp(0) = 1``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Optional

import flax
import jax
import jax.numpy as jnp
import optax

from pcsr_jax import augment, losses
from pcsr_jax.methods.base import AdaptState, Method, Prepared, is_layernorm_param
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import kept_row_chunks, shard_rows

Array = jax.Array
Params = Any


@flax.struct.dataclass
class ROIDState:
  """The class-probability EMA ``[C]`` and the source values of the trainable params."""

  probs_ema: Array
  source: Params


@dataclasses.dataclass(frozen=True)
class ROIDPrepared(Prepared):
  """`Prepared` plus the configured batch size, by which the official divides the summed losses."""

  batch_size: int = 64


def soft_likelihood_ratio(logits: Array, clip: float = 0.99, eps: float = 1e-5) -> Array:
  """``-sum_c p_c log(p_c / (1 - p_c) + eps)`` per sample with ``p`` clamped to ``clip`` (DT ``losses.py``).

  The clamp passes no gradient above ``clip``, as ``torch.clamp``'s.
  """
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  p = jnp.where(p > clip, clip, p)
  return -jnp.sum(p * jnp.log(p / (1.0 - p) + eps), axis=-1)


def symmetric_cross_entropy(x: Array, x_ema: Array, alpha: float = 0.5) -> Array:
  """``-(1 - a) sum softmax(x_ema) log_softmax(x) - a sum softmax(x) log_softmax(x_ema)`` per sample."""
  lx, le = jax.nn.log_softmax(x, axis=-1), jax.nn.log_softmax(x_ema, axis=-1)
  return -(1 - alpha) * jnp.sum(jnp.exp(le) * lx, axis=-1) - alpha * jnp.sum(jnp.exp(lx) * le, axis=-1)


def _min_max(x: Array, valid: Array) -> Array:
  lo = jnp.min(jnp.where(valid, x, jnp.inf))
  hi = jnp.max(jnp.where(valid, x, -jnp.inf))
  span = hi - lo
  return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def sample_weights(logits: Array, probs_ema: Array, valid: Array, temperature: float) -> tuple[Array, Array]:
  """ROID's ``(weights, keep)`` over the batch: 0 weight and ``keep`` False for masked and padding rows."""
  probs = jax.nn.softmax(logits, axis=-1)
  # F.cosine_similarity; its eps (1e-8 on each norm) never acts: a probability vector's norm is >= 1/sqrt(C).
  cos = probs @ probs_ema / (jnp.linalg.norm(probs, axis=-1) * jnp.linalg.norm(probs_ema))
  w_div = _min_max(1.0 - cos, valid)
  keep = valid & ~(w_div < losses.masked_mean(w_div, valid))
  w_cert = _min_max(-losses.entropy(logits), valid)
  weights = jnp.exp(w_div * w_cert / temperature)
  return jnp.where(keep, weights, 0.0), keep


def batch_mean_probs(logits: Array, valid: Array) -> Array:
  """Mean softmax over the valid rows, ``[C]``."""
  w = valid.astype(jnp.float32)[:, None]
  return jnp.sum(jax.nn.softmax(logits, axis=-1) * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)


def prior_correction(logits: Array, valid: Array) -> Array:
  """The official output correction: the logits times the smoothed batch prior (see the module doc)."""
  prior = batch_mean_probs(logits, valid)
  n, c = jnp.maximum(jnp.sum(valid), 1), logits.shape[-1]
  smooth = jnp.maximum(1.0 / n, 1.0 / c) / jnp.max(prior)
  return logits * ((prior + smooth) / (1.0 + smooth * c))


def ema(params: Params, other: Params, momentum: float | Array) -> Params:
  """DT's ``ema_update_model``: ``momentum * params + (1 - momentum) * other``, leaf by leaf."""
  return jax.tree.map(lambda p, q: momentum * p + (1 - momentum) * q, params, other)


@dataclasses.dataclass(frozen=True)
class ROIDBase(Method, abc.ABC):
  """ROID's loss, weights, consistency, optimizer and prior correction; `merge` is what follows the step."""

  # The consistency pass (forward and backward) runs on the kept rows only (about half), as the official's.
  cost: ClassVar[str] = "1F+1B (+1F+1B on the kept rows)"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)

  lr: float = field(2.5e-4, "> 0")  # not scaled with the batch size (DT)
  momentum: float = field(0.9, "[0, 1)")
  nesterov: bool = True
  temperature: float = field(1.0 / 3.0, "> 0")
  momentum_probs: float = field(0.9, "[0, 1]")
  use_weighting: bool = True
  use_consistency: bool = True
  use_prior_correction: bool = True
  # the checkpoint's normalisation, for the augmentation (one value per RGB channel)
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)
  # The consistency pass runs over the kept rows in chunks of ceil(B / consistency_chunks) rows (rounded up to
  # a multiple of the devices): more chunks waste less on a partly filled chunk, fewer fill big devices better.
  consistency_chunks: int = field(4, ">= 1")

  def prepare(self, model, params, rng, batch_size):
    tx = optax.sgd(self.lr, momentum=self.momentum or None, nesterov=self.nesterov)  # == torch's Nesterov
    return ROIDPrepared(model, params, is_trainable=is_layernorm_param, tx=tx, batch_size=batch_size)

  def init_extra(self, prep, trainable, opt_state):
    c = prep.model.config.num_classes
    return ROIDState(probs_ema=jnp.full((c,), 1.0 / c, jnp.float32), source=jax.tree.map(jnp.array, trainable))

  @abc.abstractmethod
  def merge(self, extra: Any, trainable: Params) -> tuple[Any, Params, dict[str, Array]]:
    """After the SGD step: ``(extra, trainable, metrics)`` with the params merged towards the source."""

  def augment(self, key: Array, images: Array) -> Array:
    """The consistency views of normalised ``images``: one ROID augmentation draw for the batch."""
    x01 = augment.denormalize(images, self.mean, self.std)
    return augment.normalize(augment.roid_augment(key, x01), self.mean, self.std)

  def update(self, prep, frozen, state, images, valid):
    rng, key = jax.random.split(state.rng)
    views = self.augment(key, images) if self.use_consistency else None
    return self.adapt(prep, frozen, state.replace(rng=rng), images, valid, views)

  def adapt(self, prep: ROIDPrepared, frozen: Params, state: AdaptState, images: Array, valid: Array,
            views: Optional[Array]) -> tuple[AdaptState, Array, dict[str, Array]]:
    """The step given the augmented ``views`` (normalised, one per image; only the kept rows are used)."""
    extra = state.extra
    logits, pullback = jax.vjp(lambda t: self.forward(prep, frozen, t, images)[0], state.trainable)
    if self.use_weighting:
      weights, keep = sample_weights(logits, extra.probs_ema, valid, self.temperature)
    else:
      weights, keep = valid.astype(jnp.float32), valid

    def slr(lg):
      return jnp.sum(jnp.where(keep, soft_likelihood_ratio(lg) * weights, 0.0))

    loss, dlogits = jax.value_and_grad(slr)(logits)
    grads = None
    if self.use_consistency:
      sce, grads, dlogits_sce = self.consistency(prep, frozen, state.trainable, views, logits, weights, keep)
      loss, dlogits = loss + sce, dlogits + dlogits_sce
    # One backward of the loss forward for both terms (the SCE target, ``outputs``, is not detached).
    (grads_loss,) = pullback(dlogits)
    grads = grads_loss if grads is None else jax.tree.map(jnp.add, grads_loss, grads)
    scale = 1.0 / prep.batch_size
    state = self.apply_gradients(prep, state, jax.tree.map(lambda g: g * scale, grads))
    loss = loss * scale
    if self.use_weighting:
      probs_ema = self.momentum_probs * extra.probs_ema + (1 - self.momentum_probs) * batch_mean_probs(logits, valid)
      extra = extra.replace(probs_ema=probs_ema)
    extra, trainable, merge_metrics = self.merge(extra, state.trainable)
    state = state.replace(trainable=trainable, extra=extra, step=state.step + 1)
    if self.use_prior_correction:
      logits = prior_correction(logits, valid)
    return state, logits, {"loss": loss, "num_kept": jnp.sum(keep), **merge_metrics}

  def consistency(self, prep: ROIDPrepared, frozen: Params, trainable: Params, views: Array, logits: Array,
                  weights: Array, keep: Array) -> tuple[Array, Params, Array]:
    """``sum_kept weight * SCE(model(view), logits)`` and its gradients (w.r.t. the trainable params and
    ``logits``), summed over the kept rows only.

    As the official forwards ``imgs_test[~mask]``, the views of the kept rows only go through the model: in
    chunks of ``ceil(B / consistency_chunks)`` rows (`kept_row_chunks`), as many chunks as hold kept rows,
    so a batch that keeps half its samples pays for about half a batch, with one compiled pass.
    """
    kept_rows = kept_row_chunks(prep, keep, self.consistency_chunks)

    def chunk(i, carry):
      loss, grads, dlogits = carry
      rows, kept = kept_rows.chunk(i)

      def sce(t, target):
        aug_logits, _ = self.forward(prep, frozen, t, shard_rows(prep, views[rows]))
        return jnp.sum(jnp.where(kept, symmetric_cross_entropy(aug_logits, target) * weights[rows], 0.0))

      value, (g, d) = jax.value_and_grad(sce, argnums=(0, 1))(trainable, shard_rows(prep, logits[rows]))
      return loss + value, jax.tree.map(jnp.add, grads, g), dlogits.at[rows].add(d)

    init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, trainable), jnp.zeros_like(logits))
    return jax.lax.fori_loop(0, kept_rows.num_chunks, chunk, init)


@dataclasses.dataclass(frozen=True)
class ROID(ROIDBase):
  name: ClassVar[str] = "roid"
  momentum_src: float = field(0.99, "[0, 1]")  # weight ensembling: param <- 0.99 param + 0.01 source

  def merge(self, extra, trainable):
    return extra, ema(trainable, extra.source, self.momentum_src), {}
