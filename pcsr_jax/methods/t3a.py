"""T3A (Iwasawa & Matsuo, NeurIPS 2021): the Test-Time Template Adjuster, backprop-free.

As its official code (``matsuolab/T3A:domainbed/adapt_algorithms.py``) and its ViT port
(``mr-eggplant/FOA:tta_library/t3a.py``, K = 20 for ViT/ImageNet) run it:

* Nothing is trained. The linear head is replaced by class prototypes built from test features: the
  pre-logit feature z (the final-LN class token, unnormalised).
* Supports start as the head's weight rows, each labelled ``argmax(head(row))`` (the head *with* its bias)
  with the entropy of ``head(row)`` as its score. Every batch appends its features with the labels
  ``argmax(head(z))`` and entropies of ``head(z)``; then each class keeps its ``filter_k`` lowest-entropy
  supports (warm-up rows compete with test features).
* Prediction: ``weights = normalize_cols(normalize_rows(supports)^T @ one_hot_labels)``, logits ``z @
  weights``, no bias. The batch joins the supports *before* it is predicted, so only ``eval_order='before'``
  exists (the engine's 'after' would re-run the plain head).

The official code keeps growing tensors and re-selects with a per-class ``torch.sort``. Here the supports
live in a fixed-size store, ``[C, K, D]`` with entropies (``+inf`` for empty slots) and a validity mask,
each class's valid slots first and sorted by entropy. A batch merges in with one stable sort per class
over ``(old K slots, batch B)``: exactly the official "concatenate, then keep the K lowest per class",
since every support the official code would drop from a class is never among its K lowest again.
Ties: equal entropies keep their order in the concatenation, i.e. the older support wins, and within a
batch the earlier row (a stable sort; ``torch.sort``'s default leaves exact ties unspecified). A class with
fewer than K supports keeps all of them; a class with none has a zero prototype (logit 0), as
``F.normalize`` gives. Padded rows of a ragged batch never enter (``valid``).

``class_subset`` models (ImageNet-R/-A): the head is restricted to the subset's classes (their weight rows,
biases and logits), so the prototypes and the predictions live in the subset's label space, as the model's
own logits do. (FOA's port has an ImageNet-R branch, but it reads an undefined variable.)

``filter_k = -1`` ("keep all" in DomainBed) is not offered: the store needs a bound, and the official code
would in fact apply ``[:-1]`` and drop each class's last support. For the same reason a ``filter_k`` whose store
would pass `MAX_STORE_BYTES` is refused in one line (naming the largest for the model) where the official code
would take it: there the supports grow with the stream and ``[:filter_K]`` keeps all of a class's supports when
it holds fewer, so a huge K means "keep every support"; a fixed-size store cannot know how many a stream brings,
and allocating ``filter_k`` slots per class ran out of memory (1e8: ``RESOURCE_EXHAUSTED``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax
import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, merge, require_head
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array

# The most the support store's features (``[C, filter_k, D]`` float32) may take: at ViT-B/16 on ImageNet (1000
# classes, 768 features) filter_k up to 699, at ViT-L/16 up to 524; DomainBed's grid goes to 100, as CFA's repo.
MAX_STORE_BYTES = 2**31


@flax.struct.dataclass
class Supports:
  """T3A's support set: per class, ``K`` slots of features, their entropies and whether they are filled.

  The valid slots of a class come first, sorted by entropy (ties in arrival order); empty slots have
  entropy ``+inf``. The label of a support is its class index.
  """

  features: Array  # [C, K, D]
  entropy: Array  # [C, K]
  valid: Array  # [C, K] bool

  @staticmethod
  def empty(num_classes: int, k: int, dim: int) -> "Supports":
    return Supports(features=jnp.zeros((num_classes, k, dim), jnp.float32),
                    entropy=jnp.full((num_classes, k), jnp.inf, jnp.float32),
                    valid=jnp.zeros((num_classes, k), bool))


def merge_supports(store: Supports, z: Array, labels: Array, ent: Array, valid: Array) -> Supports:
  """The store after adding candidates ``z`` ``[B, D]`` with ``labels`` ``[B]`` and entropies ``ent``
  ``[B]`` (rows where ``valid`` is False are ignored): per class the K lowest-entropy of old + new.

  One stable sort per class of the ``K + B`` candidates by (not valid, entropy): the old slots come first
  in the concatenation, so ties keep the older support, and batch rows keep their order.
  """
  c, k, _ = store.features.shape
  b = z.shape[0]
  member = valid[None, :] & (labels[None, :] == jnp.arange(c)[:, None])  # [C, B]: row j is a candidate of c
  cand_valid = jnp.concatenate([store.valid, member], axis=1)  # [C, K + B]
  cand_ent = jnp.concatenate([store.entropy, jnp.broadcast_to(ent.astype(jnp.float32), (c, b))], axis=1)
  cand_ent = jnp.where(cand_valid, cand_ent, jnp.inf)
  pos = jnp.broadcast_to(jnp.arange(k + b), (c, k + b))
  empty, ent_sorted, pos_sorted = jax.lax.sort((~cand_valid, cand_ent, pos), dimension=1, is_stable=True,
                                               num_keys=2)
  pos_k, ent_k, valid_k = pos_sorted[:, :k], ent_sorted[:, :k], ~empty[:, :k]
  old = jnp.take_along_axis(store.features, jnp.minimum(pos_k, k - 1)[..., None], axis=1)
  new = z.astype(jnp.float32)[jnp.clip(pos_k - k, 0, b - 1)]
  features = jnp.where((pos_k < k)[..., None], old, new)
  return Supports(features=jnp.where(valid_k[..., None], features, 0.0), entropy=ent_k, valid=valid_k)


def prototype_logits(store: Supports, z: Array) -> Array:
  """``z @ normalize_cols(normalize_rows(supports)^T @ labels)``: the T3A head (no bias, z unnormalised)."""
  eps = 1e-12  # F.normalize's
  s = store.features / jnp.maximum(jnp.linalg.norm(store.features, axis=-1, keepdims=True), eps)
  w = jnp.sum(jnp.where(store.valid[..., None], s, 0.0), axis=1)  # [C, D]: the sum of each class's supports
  w = w / jnp.maximum(jnp.linalg.norm(w, axis=-1, keepdims=True), eps)
  return z.astype(jnp.float32) @ w.T


def head_weights(model, params) -> tuple[Array, Array]:
  """The linear head as ``(kernel [D, C], bias [C])``, restricted to ``model.class_subset`` if set."""
  kernel, bias = jnp.asarray(params["head"]["kernel"]), jnp.asarray(params["head"]["bias"])
  if getattr(model, "class_subset", None) is not None:
    idx = jnp.asarray(model.class_subset, jnp.int32)
    kernel, bias = kernel[:, idx], bias[idx]
  return kernel, bias


@dataclasses.dataclass(frozen=True)
class T3A(Method):
  name: ClassVar[str] = "t3a"
  cost: ClassVar[str] = "1F"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the batch joins the supports before its prediction
  # supports kept per class (FOA and Benchmark-TTA for ViT/ImageNet; CFA's repo: 100); at most what a store of
  # MAX_STORE_BYTES holds (checked in `prepare`, which knows the classes and features)
  filter_k: int = field(20, ">= 1")

  def prepare(self, model, params, rng, batch_size):
    require_head("t3a", model, params)
    dim, classes = params["head"]["kernel"].shape
    if getattr(model, "class_subset", None) is not None:
      classes = len(model.class_subset)
    most = MAX_STORE_BYTES // (4 * classes * dim)
    if self.filter_k > most:
      raise UserError(f"t3a filter_k: expected at most {most} with {classes} classes of {dim} features (a support "
                      f"store of at most {MAX_STORE_BYTES / 2**30:g} GiB), got {self.filter_k}")
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def init_extra(self, prep, trainable, opt_state):
    """The warm-up supports: the head's weight rows, labelled and scored by the head itself."""
    kernel, bias = head_weights(prep.model, prep.params)
    rows = kernel.T  # [C, D]: torch's head.weight
    logits = rows @ kernel + bias
    store = Supports.empty(rows.shape[0], self.filter_k, rows.shape[1])
    return merge_supports(store, rows, jnp.argmax(logits, -1), losses.entropy(logits),
                          jnp.ones(rows.shape[0], bool))

  def update(self, prep, frozen, state, images, valid):
    params = merge(frozen, state.trainable)
    z = in_row_passes(prep, lambda x: prep.model.apply({"params": params}, x, pre_logits=True), images)
    kernel, bias = head_weights(prep.model, params)
    head_logits = z @ kernel + bias
    ent = losses.entropy(head_logits)
    store = merge_supports(state.extra, z, jnp.argmax(head_logits, -1), ent, valid)
    logits = prototype_logits(store, z)
    metrics = {"entropy": losses.masked_mean(ent, valid), "supports": jnp.sum(store.valid)}
    return state.replace(step=state.step + 1, extra=store), logits, metrics
