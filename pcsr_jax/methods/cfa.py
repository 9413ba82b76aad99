"""CFA, class-conditional feature alignment (Kojima et al., IJCAI 2022), as in its official code.

Official code: ``kojima-takeshi188/CFA:utils_adapt.py`` (loss, optimizer, params), ``utils_statistics.py``
(source statistics), ``utils.py`` (``h_std``), ``utils_model.py`` (the head-input hook), ``main.py`` (defaults).

* Adapted ('partial'): every parameter whose name contains 'norm', i.e. all LayerNorms, final norm included.
* Feature: h = tanh(LayerNorm(z)), z the head's input (the final norm's class token), the LayerNorm without
  affine params and eps 1e-5 (``h_std``), so h lies in (-1, 1) (``--value_min -1 --value_max 1``).
* Source statistics (``calc_cmd_statistics``, over the labelled source set): the mean of h and its central
  moments 2..5 (``--save_max_moment 5``), and the per-class mean of h under the ground-truth labels. The code
  also stores per-class central moments, which the default loss (``--cls_max_moment 1``) never reads: not kept.
* Loss (``cmd_optimization``, ``cmd_optimization_for_cls``): for k = 1..K (``--full_max_moment 3``) the L2
  distance between the batch's k-th moment (central for k >= 2, about the batch mean) and the source's, over
  2^k; plus, over the classes of the current argmax pseudo-labels, the mean over those classes of the L2
  distance between the batch class mean and the source class mean, over 2. Total = lambda1 full + lambda2 class.
* Optimizer: SGD(lr 1e-3, momentum 0.9); the code does not scale the lr with the batch size (its default is
  64). Before the step, ``clip_grad_norm_(max_norm=1.0)``: every gradient times
  ``min(1, max_norm / (total_norm + 1e-6))``, the total norm over all adapted params.
* The reported prediction is the loss forward's (before the update).

One deviation: a pseudo-class without any source image has a 0/0 (NaN) source mean in the official code,
which turns the loss and then every param NaN. Here such classes are left out of the class term (a source
set with every class, e.g. ImageNet train, never has one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, image_shape, is_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import sgd
from pcsr_jax.methods.rows import features_and_logits

SAVE_MAX_MOMENT = 5  # main.py --save_max_moment: the statistics hold moments 1..5
VALUE_RANGE = 2.0  # value_max - value_min of tanh's output
H_STD_EPS = 1e-5  # utils.h_std: nn.LayerNorm(d, eps=1e-05, elementwise_affine=False)


def standardize(z: jax.Array) -> jax.Array:
  """``h_std``: tanh of a LayerNorm without affine params."""
  z = z.astype(jnp.float32)
  mu = jnp.mean(z, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(z - mu), axis=-1, keepdims=True)
  return jnp.tanh((z - mu) * jax.lax.rsqrt(var + H_STD_EPS))


def clip_grad_norm_torch(max_norm: float) -> optax.GradientTransformation:
  """``torch.nn.utils.clip_grad_norm_``: gradients times ``min(1, max_norm / (total_norm + 1e-6))``.

  optax.clip_by_global_norm divides by the norm itself, without the 1e-6.
  """

  def update(grads, state, params=None):
    del params
    norm = optax.tree.norm(grads)
    scale = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _safe_norm(x: jax.Array, keep: jax.Array) -> jax.Array:
  """L2 norm over the last axis where ``keep``, 0 elsewhere (no NaN gradient from sqrt at 0)."""
  sq = jnp.sum(jnp.square(x), axis=-1)
  return jnp.where(keep, jnp.sqrt(jnp.where(keep, sq, 1.0)), 0.0)


@dataclasses.dataclass(frozen=True)
class CFA(Method):
  name: ClassVar[str] = "cfa"
  source_data: ClassVar[str] = "required"
  source_images: ClassVar[Optional[int]] = None  # the whole source (training) set
  source_labels: ClassVar[bool] = True

  lr: float = field(1e-3, "> 0")  # main.py --learning_rate_test (not scaled with the batch size)
  momentum: float = field(0.9, "[0, 1)")
  max_grad_norm: Optional[float] = field(1.0, "> 0")  # None: --clip_grad_off
  full_max_moment: int = field(3, f"[1, {SAVE_MAX_MOMENT}]")
  lambda1: float = field(1.0, ">= 0")  # weight of the full moment matching
  lambda2: float = field(1.0, ">= 0")  # weight of the class-conditional term

  def prepare(self, model, params, rng, batch_size):
    tx = sgd(self.lr, self.momentum)
    if self.max_grad_norm is not None:
      tx = optax.chain(clip_grad_norm_torch(self.max_grad_norm), tx)
    return Prepared(model, params, is_trainable=is_layernorm_param, tx=tx)

  @staticmethod
  def features(prep: Prepared, frozen: Any, trainable: Any, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(logits, h)``: the model's logits and the standardized head input."""
    z, logits = features_and_logits(prep, merge(frozen, trainable), images)
    return logits, standardize(z)

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """``mean`` [D], ``moment_k`` [D] (central, k = 2..5), ``class_mean`` [C, D], ``class_count`` [C].

    One pass: float64 power sums on the host, turned into central moments at the end (the official code
    makes a second pass about the mean; the same numbers, up to its float32 sums). ``C`` is the checkpoint's
    class count (source labels index its classes).
    """
    feats = jax.jit(lambda images: self.features(prep, frozen, trainable, images)[1])
    num_classes = prep.model.config.num_classes
    sums = None
    class_sum, class_count, total, size = None, np.zeros(num_classes, np.int64), 0, None
    for images, labels in batches:
      images, labels = np.asarray(images, np.float32), np.asarray(labels)
      n = images.shape[0]
      if labels.shape != (n,) or labels.min() < 0 or labels.max() >= num_classes:
        raise UserError(f"cfa: needs a source label in 0..{num_classes - 1} for every source image")
      size = n if size is None else size
      if n < size:  # pad to the first batch's size: one compile for the whole pass
        images = np.concatenate([images, np.zeros((size - n,) + images.shape[1:], np.float32)])
      h = np.asarray(feats(images), np.float64)[:n]
      powers = np.stack([np.sum(h ** k, axis=0) for k in range(1, SAVE_MAX_MOMENT + 1)])
      sums = powers if sums is None else sums + powers
      if class_sum is None:
        class_sum = np.zeros((num_classes, h.shape[1]), np.float64)
      np.add.at(class_sum, labels, h)
      class_count += np.bincount(labels, minlength=num_classes)
      total += n
    if total == 0:
      raise UserError("cfa: no source images for the statistics")
    raw = sums / total  # E[h^k], k = 1..5
    mu = raw[0]
    out = {"mean": mu}
    for k in range(2, SAVE_MAX_MOMENT + 1):  # E[(h - mu)^k] = sum_i C(k, i) E[h^i] (-mu)^(k - i)
      out[f"moment_{k}"] = sum(math.comb(k, i) * (raw[i - 1] if i else 1.0) * (-mu) ** (k - i) for i in range(k + 1))
    out["class_mean"] = class_sum / np.maximum(class_count, 1)[:, None]
    out = {k: v.astype(np.float32) for k, v in out.items()}
    out["class_count"] = class_count.astype(np.int32)
    return out

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    d = jax.eval_shape(lambda x: self.features(prep, frozen, trainable, x)[1], image_shape(prep.model)).shape[-1]
    c = prep.model.config.num_classes
    out = {k: jax.ShapeDtypeStruct((d,), np.float32)
           for k in ["mean"] + [f"moment_{k}" for k in range(2, SAVE_MAX_MOMENT + 1)]}
    return dict(out, class_mean=jax.ShapeDtypeStruct((c, d), np.float32),
                class_count=jax.ShapeDtypeStruct((c,), np.int32))

  def update(self, prep, frozen, state, images, valid):
    consts = prep.consts
    subset = prep.model.class_subset
    class_mean, class_count = consts["class_mean"], consts["class_count"]
    if subset is not None:  # the logits are a subset of the checkpoint's classes: their statistics
      idx = jnp.asarray(subset, jnp.int32)
      class_mean, class_count = class_mean[idx], class_count[idx]

    def loss_fn(trainable):
      logits, h = self.features(prep, frozen, trainable, images)
      w = valid.astype(jnp.float32)
      n = jnp.maximum(jnp.sum(w), 1.0)
      mu = jnp.sum(w[:, None] * h, axis=0) / n
      full = jnp.linalg.norm(mu - consts["mean"]) / VALUE_RANGE
      for k in range(2, self.full_max_moment + 1):
        mk = jnp.sum(w[:, None] * (h - mu) ** k, axis=0) / n
        full = full + jnp.linalg.norm(mk - consts[f"moment_{k}"]) / VALUE_RANGE ** k
      onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1]) * w[:, None]  # no gradient
      counts = jnp.sum(onehot, axis=0)
      batch_class_mean = jnp.einsum("bc,bd->cd", onehot, h, precision="highest") / jnp.maximum(counts, 1)[:, None]
      present = (counts > 0) & (class_count > 0)
      dist = _safe_norm(batch_class_mean - class_mean, present) / VALUE_RANGE
      cls = jnp.sum(dist) / jnp.maximum(jnp.sum(present), 1)
      loss = self.lambda1 * full + self.lambda2 * cls
      return loss, (logits, full, cls, jnp.sum(present))

    (loss, (logits, full, cls, classes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
    state = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    return state, logits, {"loss": loss, "loss_full": full, "loss_class": cls, "num_classes": classes,
                           "grad_norm": optax.tree.norm(grads)}
