"""AdaContrast (Chen et al., CVPR 2022), online, as DT's ``classification/methods/adacontrast.py`` runs it.

DT (mariodoebler/test-time-adaptation) ``methods/adacontrast.py``, ``augmentations/transforms_adacontrast.py``,
``cfgs/imagenet_c/adacontrast.yaml``; the method of ``DianCh/AdaContrast:target.py`` made online:

* Adapted: all params (no projector: the feature is the 768-d pre-logit class token, the final LayerNorm's
  output that the head reads). SGD lr 2e-4, momentum 0.9, Nesterov, weight decay 1e-4, one step per batch;
  DT's ``setup_optimizer`` does not scale the lr with the batch size and neither does this.
* State (`AdaContrastState`): the MoCo key encoder (an EMA of the student, momentum 0.999, updated with the
  pre-step student right before the key forward); the key queue of ``queue_size`` (16,384) normalised
  features and pseudo-labels, which DT starts FULL of random unit vectors and random labels (drawn here from
  ``seed``); the kNN bank of the key encoder's weak-view features and softmax probabilities, which starts
  empty and becomes a ring of ``queue_size`` entries. Both are fixed-size buffers with a write pointer.
* Per batch (views: weak = h-flip, two "moco-v2-light" strong views q and k, `pcsr_jax.augment`):
  1. student forward of the weak view -> probabilities; pseudo-label = argmax while fewer than ``warmup``
     (1,024) samples have been seen before this batch (DT's ``first_X_samples``), afterwards the argmax of
     the mean stored probabilities of the ``num_neighbors`` (10) nearest bank entries (cosine distance to the
     student's weak feature);
  2. key encoder EMA, then its normalised features of the strong view k;
  3. the keys and pseudo-labels are enqueued BEFORE the loss (DT's order): the negatives' features are the
     queue before the enqueue, the class-aware mask compares with the labels after it;
  4. loss on the student's strong view q: CE(logits, pseudo-label) + InfoNCE over [positive key, queue]
     at T 0.07 with queue entries of the query's pseudo-label masked out + diversity
     ``sum(p_mean * log(p_mean + 1e-8))`` of the batch-mean softmax (weights ``alpha``, ``beta``, ``eta``: 1);
  5. SGD step; the key encoder re-encodes the weak view and its features/probabilities go into the bank.
* Prediction: DT's ``forward`` predicts after the update with a separate forward of the plain test view by
  the student, which is exactly the engine's "after" (a forward of the updated trainable params on the
  images): ``eval_orders = ("after",)``. Cost: student weak + student q (with backward) + key q/k + key weak +
  test forward = "5F+1B".

Padded rows enter no loss, statistic, queue or bank. Deviations: the views are `pcsr_jax.augment`'s (tensor
colour ops, an exact Gaussian blur); DT's bank grows by whole batches to the first size >= ``queue_size``
(16,384 + up to B - 1 entries when B does not divide it), here it is capped at ``queue_size``; random numbers
are JAX's. The images arrive normalised: views are built on ``denormalize(x, mean, std)``, normalised back
(``mean``/``std``: the checkpoint's, default the augreg ViT's 0.5).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax
import jax
import jax.numpy as jnp
import optax

from pcsr_jax import augment
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import AdaptState, Method, Prepared, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import features_and_logits

Array = jax.Array


@flax.struct.dataclass
class AdaContrastState:
  """The key encoder's params, the MoCo key queue and the kNN bank (rings with write pointers)."""

  momentum: Any
  queue: Array  # [K, D] normalised keys
  queue_labels: Array  # [K] int32
  queue_ptr: Array
  bank_feats: Array  # [K, D] key-encoder weak-view features (unnormalised)
  bank_probs: Array  # [K, C]
  bank_ptr: Array
  bank_filled: Array
  seen: Array  # valid samples pseudo-labelled by argmax so far (DT's first_X_samples)


def ring_write(buf: Array, ptr: Array, rows: Array, valid: Array) -> tuple[Array, Array]:
  """Writes the valid ``rows`` at ``ptr, ptr + 1, ...`` (mod the buffer's length), in order; returns
  ``(buf, new ptr)``. DT's ``update_memory``/``update_labels`` on the valid rows."""
  k = buf.shape[0]
  rank = jnp.cumsum(valid.astype(jnp.int32)) - 1
  idx = jnp.where(valid, (ptr + rank) % k, k)  # out of range: dropped
  return buf.at[idx].set(rows, mode="drop"), (ptr + jnp.sum(valid.astype(jnp.int32))) % k


def knn_probs(features: Array, bank_feats: Array, bank_probs: Array, filled: Array, k: int) -> Array:
  """Mean stored probabilities of the ``k`` bank entries nearest to each feature (cosine distance); only the
  first ``filled`` entries exist. DT's ``soft_k_nearest_neighbors`` with ``dist_type='cosine'``."""
  f = features / jnp.maximum(jnp.linalg.norm(features, axis=1, keepdims=True), 1e-12)
  b = bank_feats / jnp.maximum(jnp.linalg.norm(bank_feats, axis=1, keepdims=True), 1e-12)
  dist = 1.0 - f @ b.T
  dist = jnp.where(jnp.arange(bank_feats.shape[0]) < filled, dist, jnp.inf)
  _, idx = jax.lax.top_k(-dist, k)
  return jnp.mean(bank_probs[idx], axis=1)


def instance_logits(q: Array, keys: Array, queue: Array, temperature: float) -> Array:
  """MoCo logits ``[B, 1 + K]``: the positive key first, then the queue, over ``temperature``."""
  l_pos = jnp.sum(q * keys, axis=1, keepdims=True)
  return jnp.concatenate([l_pos, q @ queue.T], axis=1) / temperature


def class_aware_mask(labels: Array, queue_labels: Array) -> Array:
  """``[B, 1 + K]``: True where a logit is kept (the positive, and negatives of another pseudo-label)."""
  neg = labels[:, None] != queue_labels[None, :]
  return jnp.concatenate([jnp.ones((labels.shape[0], 1), bool), neg], axis=1)


def l2_normalize(x: Array) -> Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)  # F.normalize


@dataclasses.dataclass(frozen=True)
class AdaContrast(Method):
  name: ClassVar[str] = "adacontrast"
  cost: ClassVar[str] = "5F+1B"
  default_eval_order: ClassVar[str] = "after"
  eval_orders: ClassVar[tuple[str, ...]] = ("after",)

  lr: float = field(2e-4, "> 0")
  momentum: float = field(0.9, "[0, 1)")
  weight_decay: float = field(1e-4, ">= 0")
  nesterov: bool = True
  ema: float = field(0.999, "[0, 1]")  # key encoder momentum (DT M_TEACHER.MOMENTUM)
  queue_size: int = field(16384, ">= 1")
  temperature: float = field(0.07, "> 0")
  num_neighbors: int = field(10, ">= 1")
  warmup: int = field(1024, ">= 0")  # samples labelled by plain argmax before the kNN refinement starts
  alpha: float = field(1.0, ">= 0")  # CE
  beta: float = field(1.0, ">= 0")  # InfoNCE
  eta: float = field(1.0, ">= 0")  # diversity
  seed: int = field(0, ">= 0")  # the random initial queue
  # the checkpoint's normalisation (augreg ViT), one value per RGB channel (the augmentations')
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)

  def prepare(self, model, params, rng, batch_size):
    if self.queue_size < batch_size:
      raise UserError(f"adacontrast queue_size: expected at least the batch size ({batch_size}), "
                      f"got {self.queue_size}")
    tx = optax.chain(optax.add_decayed_weights(self.weight_decay),  # torch SGD: g + wd * p, then momentum
                     optax.sgd(self.lr, momentum=self.momentum or None, nesterov=self.nesterov))
    return Prepared(model, params, is_trainable=lambda path: True, tx=tx)

  def init_extra(self, prep, trainable, opt_state):
    c = prep.model.config
    d = c.embed_dim
    classes = len(prep.model.class_subset) if prep.model.class_subset is not None else c.num_classes
    k_feat, k_lab = jax.random.split(jax.random.key(self.seed))
    return AdaContrastState(
        momentum=jax.tree.map(jnp.copy, trainable),
        queue=l2_normalize(jax.random.normal(k_feat, (self.queue_size, d))),
        queue_labels=jax.random.randint(k_lab, (self.queue_size,), 0, classes),
        queue_ptr=jnp.zeros((), jnp.int32),
        bank_feats=jnp.zeros((self.queue_size, d)), bank_probs=jnp.zeros((self.queue_size, classes)),
        bank_ptr=jnp.zeros((), jnp.int32), bank_filled=jnp.zeros((), jnp.int32), seen=jnp.zeros((), jnp.int32))

  def draw_views(self, key: Array, images: Array) -> tuple[Array, Array, Array]:
    """Normalised (weak, strong q, strong k) views of normalised images."""
    x01 = augment.denormalize(images, self.mean, self.std)
    kw, kq, kk = jax.random.split(key, 3)
    norm = lambda v: augment.normalize(v, self.mean, self.std)
    return (norm(augment.adacontrast_weak(kw, x01)), norm(augment.adacontrast_strong(kq, x01)),
            norm(augment.adacontrast_strong(kk, x01)))

  def adapt(self, prep: Prepared, frozen: Any, state: AdaptState, images: Array, valid: Array,
            views: tuple[Array, Array, Array]) -> tuple[AdaptState, Array, dict[str, Array]]:
    """The step on given normalised views ``(weak, strong_q, strong_k)`` (tests pass fixed ones)."""
    weak, strong_q, strong_k = views
    ex: AdaContrastState = state.extra

    n = jnp.sum(valid.astype(jnp.int32))
    w = valid.astype(jnp.float32)
    mean_valid = lambda x: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)

    feats_w, logits_w = features_and_logits(prep, merge(frozen, state.trainable), weak)
    probs_w = jax.nn.softmax(logits_w)
    use_knn = ex.seen >= self.warmup
    refined = knn_probs(feats_w, ex.bank_feats, ex.bank_probs, ex.bank_filled, self.num_neighbors)
    labels = jnp.where(use_knn, jnp.argmax(refined, axis=1), jnp.argmax(probs_w, axis=1))
    seen = jnp.where(use_knn, ex.seen, ex.seen + n)

    momentum = jax.tree.map(lambda k, q: k * self.ema + q * (1.0 - self.ema), ex.momentum, state.trainable)
    keys = l2_normalize(features_and_logits(prep, merge(frozen, momentum), strong_k)[0])
    old_queue = ex.queue
    queue, _ = ring_write(ex.queue, ex.queue_ptr, keys, valid)
    queue_labels, queue_ptr = ring_write(ex.queue_labels, ex.queue_ptr, labels, valid)
    mask = class_aware_mask(labels, queue_labels)

    def loss_fn(trainable):
      feats_q, logits_q = features_and_logits(prep, merge(frozen, trainable), strong_q)
      logits_ins = instance_logits(l2_normalize(feats_q), keys, old_queue, self.temperature)
      logits_ins = jnp.where(mask, logits_ins, -jnp.inf)
      loss_ins = mean_valid(-jax.nn.log_softmax(logits_ins, axis=1)[:, 0])
      log_p = jax.nn.log_softmax(logits_q, axis=1)
      loss_cls = mean_valid(-jnp.take_along_axis(log_p, labels[:, None], axis=1)[:, 0])
      p_mean = jnp.sum(jnp.exp(log_p) * w[:, None], axis=0) / jnp.maximum(jnp.sum(w), 1.0)
      loss_div = jnp.sum(p_mean * jnp.log(p_mean + 1e-8))
      loss = self.alpha * loss_cls + self.beta * loss_ins + self.eta * loss_div
      return loss, (logits_q, loss_cls, loss_ins, loss_div)

    (loss, (logits_q, loss_cls, loss_ins, loss_div)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.trainable)
    state = self.apply_gradients(prep, state, grads)

    feats_b, logits_b = features_and_logits(prep, merge(frozen, momentum), weak)
    bank_feats, bank_ptr = ring_write(ex.bank_feats, ex.bank_ptr, feats_b, valid)
    bank_probs, _ = ring_write(ex.bank_probs, ex.bank_ptr, jax.nn.softmax(logits_b), valid)
    extra = AdaContrastState(momentum=momentum, queue=queue, queue_labels=queue_labels, queue_ptr=queue_ptr,
                             bank_feats=bank_feats, bank_probs=bank_probs, bank_ptr=bank_ptr,
                             bank_filled=jnp.minimum(ex.bank_filled + n, self.queue_size), seen=seen)
    metrics = {"loss": loss, "loss_cls": loss_cls, "loss_ins": loss_ins, "loss_div": loss_div,
               "knn": use_knn.astype(jnp.int32)}
    return state.replace(step=state.step + 1, extra=extra), logits_q, metrics

  def update(self, prep, frozen, state, images, valid):
    rng, key = jax.random.split(state.rng)
    return self.adapt(prep, frozen, state.replace(rng=rng), images, valid, self.draw_views(key, images))
