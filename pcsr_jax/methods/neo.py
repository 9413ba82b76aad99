"""NEO (Murphy et al., ICLR 2026, arXiv 2510.05635): no-optimization TTA by re-centring the embeddings.

As its official code runs it (``awesomealex1/NEO`` @ cd8ac01; line numbers counted in the stored files):

* Nothing is trained and there is no backward pass. The head is replaced: the backbone's pre-logit feature z
  (timm's ViT with ``head = nn.Identity()``: the final-norm class token, ``tta_library/neo.py`` l. 7-13, 25) is
  re-centred by a running estimate c of the target embeddings' mean, and the original linear head classifies
  ``z - c`` (l. 36-37): ``logits = W (z - c) + b``, the bias kept.
* The centre is updated *before* the batch is predicted, with the batch itself (l. 32-34), so the returned
  logits already use the batch's own mean: only ``eval_order='before'`` exists (the engine's 'after' would
  re-run the plain head).
* ``neo`` (``alpha = 0``, the default; ``tta_library/neo.py`` l. 33-34, also ``neo_layers.py`` class ``NEO``
  l. 31-35): the running mean of every embedding seen since the last reset, ``n += b``,
  ``c = (n - b) / n * c + b / n * mean_batch(z)``, from ``c = 0``, ``n = 0`` (l. 26-27), so the first batch's
  centre is its own mean.
* ``alpha > 0``: the official continual variant ``neo_cont`` (``tta_library/neo_cont.py`` l. 33;
  ``neo_layers.py`` class ``NEO_Continual`` l. 66): an EMA ``c = (1 - alpha) c + alpha mean_batch(z)`` from
  ``c = 0`` (l. 26), ``alpha`` = its ``--learning_rate``, 0.1 by default (``utils/utils.py`` l. 209,
  ``neo_cont.py`` l. 19). Run it as ``--method-args '{"neo": {"alpha": 0.1}}'``.
* Resets: ``reset()`` zeroes c and n (``neo.py`` l. 43-46, ``neo_cont.py`` l. 42-44), called after every
  corruption unless ``--continual`` (``main.py`` l. 125-126); the engine's reset per domain does the same, and
  ``--setting continual`` keeps the state across domains, as ``main.py --continual`` does with either
  algorithm. (``main.py`` l. 32-33 also shuffles the corruption order under ``--continual``; our continual
  stream's order is the setting's.)
* Protocol defaults: batch 64 (``utils/utils.py`` l. 180), severity 5 (l. 193), ViT-B/16 (``factories.py``
  l. 79), adaptation on the whole stream with the online prediction reported (``--adapt_num_samples -1``,
  no ``--eval``: ``main.py`` l. 64-68), the same protocol as every method here. The paper's headline numbers
  also adapt on the first 512 samples and then evaluate the rest with the centre frozen (``--eval``,
  ``main.py`` l. 82-84); that split is not offered.

Choices the official code leaves open, settled here:

* A ragged last batch: its padding rows neither enter the batch mean nor the count (the official code sees the
  short batch itself: ``z.size(0)`` real rows, l. 33-34). A batch with no real row leaves the centre as it is.
* The centre and count are float32 and int32; the running-mean weights ``(n - b) / n`` and ``b / n`` are
  computed in float32 (PyTorch multiplies a float32 tensor by the Python float, in float32).
* ``class_subset`` models (ImageNet-R): the head's logits restricted to the subset after the re-centred head, as
  the official ``imagenet_mask`` (l. 39-40); the centre lives in feature space, so it is the same either way.

Not carried over: ``--corrupt_center_path`` (``factories.py`` l. 127-129 calls a ``set_corrupt_center`` that
the class does not define) and ``--save_shift`` (an output file); ``--adapt_label_count`` (a data filter).
Under ``--realtime`` a batch the clock skips gets the network's plain forward (`Method.forward`, the source
head), as T3A's does (`pcsr_jax.realtime`); at one forward per batch NEO's relative cost is 1, so no batch is
skipped unless its step times slower than Source's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax
import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.methods.base import Method, Prepared, merge, require_head
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array


@flax.struct.dataclass
class Center:
  """NEO's state: the estimate of the target embeddings' mean and how many embeddings it averages."""

  mean: Array  # [D] float32: c
  count: Array  # int32 scalar: n, the embeddings seen since the last reset (the running-mean form's weight)

  @staticmethod
  def zeros(dim: int) -> "Center":
    return Center(mean=jnp.zeros((dim,), jnp.float32), count=jnp.zeros((), jnp.int32))


def update_center(center: Center, z: Array, valid: Array, alpha: float) -> Center:
  """The centre after a batch of embeddings ``z`` ``[B, D]`` (rows where ``valid`` is False ignored): the running
  mean of all embeddings seen (``alpha == 0``, ``neo.py`` l. 33-34) or the EMA with weight ``alpha``
  (``neo_cont.py`` l. 33). A batch without a valid row changes nothing."""
  z = z.astype(jnp.float32)
  b = jnp.sum(valid.astype(jnp.int32))
  batch_mean = jnp.sum(jnp.where(valid[:, None], z, 0.0), axis=0) / jnp.maximum(b, 1).astype(jnp.float32)
  n = center.count + b
  if alpha == 0.0:
    nf, bf = jnp.maximum(n, 1).astype(jnp.float32), b.astype(jnp.float32)
    mean = (nf - bf) / nf * center.mean + bf / nf * batch_mean
  else:
    mean = (1.0 - alpha) * center.mean + alpha * batch_mean
  return Center(mean=jnp.where(b > 0, mean, center.mean), count=n)


@dataclasses.dataclass(frozen=True)
class NEO(Method):
  name: ClassVar[str] = "neo"
  cost: ClassVar[str] = "1F"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the batch moves the centre before its prediction
  # 0: the running mean of ``neo`` (tta_library/neo.py l. 33-34); > 0: the EMA of ``neo_cont`` (neo_cont.py
  # l. 33), whose official value is 0.1 (utils/utils.py l. 209)
  alpha: float = field(0.0, "[0, 1]")

  def prepare(self, model, params, rng, batch_size):
    require_head("neo", model, params)
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def init_extra(self, prep, trainable, opt_state):
    """c = 0 and n = 0 (``neo.py`` l. 26-27), for every domain after a reset (l. 43-46)."""
    return Center.zeros(prep.params["head"]["kernel"].shape[0])

  def update(self, prep, frozen, state, images, valid):
    params = merge(frozen, state.trainable)
    z = in_row_passes(prep, lambda x: prep.model.apply({"params": params}, x, pre_logits=True), images)
    center = update_center(state.extra, z, valid, self.alpha)
    logits = prep.model.apply({"params": params}, z - center.mean, method="classify")
    metrics = {"entropy": losses.masked_mean(losses.entropy(logits), valid),
               "center_norm": jnp.linalg.norm(center.mean), "seen": center.count}
    return state.replace(step=state.step + 1, extra=center), logits, metrics
