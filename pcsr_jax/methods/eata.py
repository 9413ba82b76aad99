"""EATA and ETA (Niu et al., ICML 2022) for ViTs, as in the official code's ViT setting.

Official code: ``mr-eggplant/SAR:eata.py`` and ``main.py`` (the ViT runs; ``mr-eggplant/EATA:eata.py`` has the
same step, BN-only).

* Adapted: every LayerNorm's scale and bias, the final norm included (``collect_params`` over nn.LayerNorm).
* Optimizer: SGD(lr = 0.001 * B / 64, momentum 0.9) (SAR's ``main.py`` for ``vitbase_timm``).
* Step (``forward_and_adapt_eata``): entropy of the forward's softmax; reliable = ``ent < E0`` with
  E0 = 0.4 ln C (``main.py``'s ``--e_margin``; the class default ln(C)/2 - 1 is overridden). Once the moving
  average ``m`` of probabilities exists, the kept samples are the reliable ones with
  ``|cos(softmax_i, m)| < d0`` (d0 = 0.05); before it exists, every reliable sample is kept and none is compared.
  ``m`` starts as the mean softmax of the first batch with a reliable sample, then becomes
  ``0.9 m + 0.1 mean(softmax of the kept samples)``, unchanged when none is kept (``update_model_probs``).
  Loss = mean over the kept samples of ``ent * exp(E0 - ent)`` (the weight detached)
  + ``fisher_alpha * sum F (theta - theta0)^2``. The code calls ``backward`` and ``optimizer.step`` only if a
  sample is kept, so a batch without one changes neither the params nor the momentum: the update is gated.
* Fisher (``main.py``): on clean source images (2,000 in the paper, in batches of the test batch size, the
  last one partial), the squared gradient of the batch-mean cross-entropy against the model's own argmax,
  summed over the batches and divided once by their number; theta0 = the params at that time (the source's).
* ETA (``fisher_alpha = 0``, registry name ``eta``) is EATA without the regularizer and needs no source data.
  EATA run without source statistics (``prep.consts`` None) drops the term too, i.e. runs as ETA.
* The reported prediction is the loss forward's (before the update).
* ``loss='come'`` (registry name ``eata-come``) is COME's EATA (``BlueWhaleLab/COME:eata_come.py``): the
  entropy of the reliability filter, the weight and the loss is `losses.come_entropy`'s; the redundancy check
  still compares softmax probabilities, and the Fisher is the same; the checkpoint's normalization, where COME's
  runs take ImageNet's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterator, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import sar_code_lr, sgd

PROBS_MOMENTUM = 0.9  # update_model_probs: 0.9 * m + (1 - 0.9) * mean(new probs)


@flax.struct.dataclass
class ProbsAverage:
  """EATA's moving average of probability vectors (``current_model_probs``); ``initialised`` False is
  PyTorch's ``None`` (then ``probs`` is zeros and unused)."""

  probs: jax.Array
  initialised: jax.Array

  @staticmethod
  def init(num_classes: int) -> "ProbsAverage":
    return ProbsAverage(probs=jnp.zeros((num_classes,), jnp.float32), initialised=jnp.zeros((), bool))


def select_samples(probs: jax.Array, ent: jax.Array, valid: jax.Array, avg: ProbsAverage, e_margin: float,
                   d_margin: float) -> tuple[jax.Array, jax.Array, ProbsAverage]:
  """EATA's two filters and the moving average's update: ``(reliable, kept, new_average)``.

  ``probs`` are the (detached) softmax rows, ``ent`` their entropies. Without an average yet, kept = reliable
  and the average becomes their mean softmax (if there is one); with it, kept = reliable and
  ``|cos(p_i, m)| < d_margin`` and ``m <- 0.9 m + 0.1 mean(kept p_i)`` (if one is kept).
  """
  reliable = losses.reliable_mask(ent, e_margin, valid)
  # F.cosine_similarity (norms clamped at 1e-8: a probability vector's norm is at least 1/sqrt(C)).
  unit = probs / jnp.maximum(jnp.linalg.norm(probs, axis=-1, keepdims=True), 1e-8)
  m_unit = avg.probs / jnp.maximum(jnp.linalg.norm(avg.probs), 1e-8)
  cos = unit @ m_unit
  kept = reliable & jnp.where(avg.initialised, jnp.abs(cos) < d_margin, True)
  n = jnp.sum(kept)
  mean_kept = jnp.sum(jnp.where(kept[:, None], probs, 0.0), axis=0) / jnp.maximum(n, 1)
  updated = jnp.where(avg.initialised, PROBS_MOMENTUM * avg.probs + (1 - PROBS_MOMENTUM) * mean_kept, mean_kept)
  new = ProbsAverage(probs=jnp.where(n > 0, updated, avg.probs), initialised=avg.initialised | (n > 0))
  return reliable, kept, new


def _key(path: tuple[str, ...]) -> str:
  return "/".join(path)


@dataclasses.dataclass(frozen=True)
class EATA(Method):
  name: ClassVar[str] = "eata"
  source_data: ClassVar[str] = "optional"  # without it: ETA
  source_images: ClassVar[Optional[int]] = 2000  # main.py --fisher_size
  source_labels: ClassVar[bool] = False  # the Fisher's targets are the model's own predictions

  lr: Optional[float] = field(None, "> 0")  # None: 0.001 * B / 64
  momentum: float = field(0.9, "[0, 1)")
  fisher_alpha: float = field(2000.0, ">= 0")  # main.py --fisher_alpha; 0: ETA
  d_margin: float = field(0.05, "> 0")  # main.py --d_margin
  loss: str = field("entropy", losses.LOSSES)  # 'come': COME's entropy over K+1 entries

  def uses_source_data(self) -> bool:
    return self.fisher_alpha != 0

  def source_free(self) -> "EATA":
    return dataclasses.replace(self, fisher_alpha=0.0)

  def source_free_note(self) -> str:
    return "ETA: no Fisher regularizer, fisher_alpha 0"

  def prepare(self, model, params, rng, batch_size):
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size)
    return Prepared(model, params, is_trainable=is_layernorm_param, tx=sgd(lr, self.momentum))

  def init_extra(self, prep, trainable, opt_state):
    subset = prep.model.class_subset  # the average is over the logits the model returns
    return ProbsAverage.init(prep.model.config.num_classes if subset is None else len(subset))

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """The diagonal Fisher of the adapted params (``fisher/<path>``) and their source values (``theta0/<path>``).

    A batch smaller than the first is padded to its size and masked, so the whole pass compiles once.
    """

    @jax.jit
    def squared_grads(trainable, images, valid):
      def ce(trainable):
        logits = prep.model.apply({"params": merge(frozen, trainable)}, images)
        targets = jax.lax.stop_gradient(jnp.argmax(logits, axis=-1))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]
        return losses.masked_mean(nll, valid)

      return jax.tree.map(jnp.square, jax.grad(ce)(trainable))

    total, num_batches, size = None, 0, None
    for images, _ in batches:
      images = np.asarray(images, np.float32)
      n = images.shape[0]
      size = n if size is None else size
      valid = np.arange(max(n, size)) < n
      if n < size:
        images = np.concatenate([images, np.zeros((size - n,) + images.shape[1:], np.float32)])
      sq = jax.tree.map(lambda x: np.asarray(x, np.float64), squared_grads(trainable, images, valid))
      total = sq if total is None else jax.tree.map(np.add, total, sq)
      num_batches += 1
    if num_batches == 0:
      raise UserError("eata: no source images for the Fisher information")
    fisher = traverse_util.flatten_dict(jax.tree.map(lambda x: (x / num_batches).astype(np.float32), total))
    theta0 = traverse_util.flatten_dict(jax.tree.map(np.asarray, trainable))
    return {**{f"fisher/{_key(k)}": v for k, v in fisher.items()},
            **{f"theta0/{_key(k)}": np.asarray(v, np.float32) for k, v in theta0.items()}}

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    leaves = traverse_util.flatten_dict(trainable)
    return {f"{kind}/{_key(k)}": jax.ShapeDtypeStruct(np.shape(v), np.float32)
            for kind in ("fisher", "theta0") for k, v in leaves.items()}

  def update(self, prep, frozen, state, images, valid):
    e_margin = self.margin(prep.model.config.num_classes)  # as SAR and TENT: ln of the checkpoint's classes
    consts = prep.consts if self.fisher_alpha != 0 else None

    logits, pullback = jax.vjp(lambda t: self.forward(prep, frozen, t, images)[0], state.trainable)
    ent = losses.adaptation_entropy(logits, self.loss)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    reliable, kept, avg = select_samples(probs, ent, valid, state.extra, e_margin, self.d_margin)
    weight = jnp.exp(e_margin - ent)  # 1 / exp(ent - E0), a constant of the loss
    entropy = lambda lg: losses.adaptation_entropy(lg, self.loss)
    loss, dlogits = jax.value_and_grad(lambda lg: losses.masked_mean(entropy(lg) * weight, kept))(logits)

    def ewc(trainable):
      return self.fisher_alpha * sum(
          jnp.sum(consts[f"fisher/{_key(k)}"] * jnp.square(p - consts[f"theta0/{_key(k)}"]))
          for k, p in traverse_util.flatten_dict(trainable).items())

    def grads():
      g = pullback(dlogits)[0]
      return g if consts is None else jax.tree.map(jnp.add, g, jax.grad(ewc)(state.trainable))

    if consts is not None:
      loss = loss + ewc(state.trainable)
    # Official: backward and optimizer.step only if x[ids1][ids2] is not empty.
    state = self.apply_gradients_if(prep, state, jnp.any(kept), grads)
    state = state.replace(step=state.step + 1, extra=avg)
    return state, logits, {"loss": loss, "num_reliable": jnp.sum(reliable), "num_kept": jnp.sum(kept)}
