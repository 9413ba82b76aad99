"""CoTTA (Wang et al., CVPR 2022): continual test-time adaptation with a mean teacher.

As ``qinenergy/cotta:imagenet/cotta.py`` runs it, with the ViT optimizer of ``mr-eggplant/FOA:main.py`` and
``mr-eggplant/SPA:main.py`` (their ``tta_library/cotta.py`` is the official file):

* Adapted (the student): every parameter a submodule holds directly under the name ``weight`` or ``bias``
  (``collect_params``): the patch-embedding conv, qkv, proj, the MLPs, every LayerNorm and the head, i.e.
  the Flax ``kernel``/``bias``/``scale`` of a submodule. ``cls_token`` and ``pos_embed`` are the root
  module's own parameters, not named weight/bias, so they stay at their source values.
* Teacher: an EMA of the student, ``teacher = mt * teacher + (1 - mt) * student`` (mt 0.999), updated after
  each optimizer step and before the stochastic restore. The official ``update_ema_variables`` runs over all
  parameters; the ones that never adapt (``cls_token``, ``pos_embed``) are fixed points of it, so the
  teacher here holds only the adapted ones and shares the rest with the student.
* Anchor: the frozen source model. If the batch mean of its max softmax probability is below ``ap`` (0.1),
  the teacher's prediction is the mean of its logits on ``n_aug`` (32) augmented views (``get_tta_transforms``,
  one random draw per view shared by the batch: `pcsr_jax.augment.cotta_augment`); otherwise it is the
  teacher's plain logits, which the official code computes in every step.
* Loss: the symmetric cross-entropy of the ImageNet code, per sample
  ``-0.5 sum softmax(t) log_softmax(s) - 0.5 sum softmax(s) log_softmax(t)`` (``t`` the detached teacher
  logits, ``s`` the student's), averaged over the batch. SGD(lr 0.005, momentum 0.9, no Nesterov) for ViTs
  as FOA/SPA run it; the lr does NOT scale with the batch size (FOA/SPA fix it at 0.005 for batch 64; the
  official ResNet-50 config is lr 0.01 with Nesterov: ``lr=0.01, nesterov=True``).
* Stochastic restore: after the teacher update, every element of every adapted parameter goes back to its
  source value with probability ``rst`` (0.001). The optimizer's momentum is left as it is.
* Prediction: the teacher's (possibly augmentation-averaged) logits, computed before this step's update, so
  ``eval_orders = ("before",)``: the student's "after" forward is not what CoTTA reports.

The official CIFAR code (``qinenergy/cotta:cifar/cotta.py``) builds the same views at 32 px: its
``get_tta_transforms`` is the ImageNet file's with ``img_shape`` 32 (padding 16, a 32 px centre crop), the
strengths unchanged, which is what the pipeline here computes on 32 px images. Its config differs elsewhere
(``cfgs/cifar10/cotta.yaml``: Adam lr 1e-3, ``rst`` 0.01, ``ap`` 0.92, batch 200, a one-sided cross-entropy).

The step receives normalized images; the augmentation works on [0, 1] pixels (the official ImageNet models
normalize inside the network), so the step denormalizes with the ``mean``/``std`` fields (default 0.5: the
augreg ViT's), augments and normalizes again. ``augment_normalized=True`` instead applies the augmentation to
the normalized tensor, as FOA/SPA's ViT runs do (their loader normalizes to [-1, 1] and the pipeline starts
by clipping to [0, 1]), for reproducing their numbers.

The 32 teacher forwards run under ``jax.lax.cond``, only on the batches that trigger them (measured on CPU,
ViT embed 96, depth 6, 64 px, batch 16: 0.20 s per untriggered step against 2.7 s for computing the views
always and selecting with ``jnp.where``; a triggered step costs the same either way). The source
parameters the anchor and the restore need are passed to the compiled step in ``Prepared.consts`` (an
argument, not constants baked into the program). Padded rows take no part in the anchor's confidence or the
loss. Randomness (views, restore masks) comes from the state's key, split each step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import flax
import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.augment import cotta_augment, denormalize, normalize
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import AdaptState, Method, Params, Path, Prepared, split
from pcsr_jax.methods.hyperparameters import field

Array = jax.Array


@flax.struct.dataclass
class CoTTAState:
  """The mean teacher: an EMA of the adapted params (same tree as ``AdaptState.trainable``)."""

  teacher: Params


def is_weight_or_bias(path: Path) -> bool:
  """A submodule's own ``weight``/``bias`` in PyTorch terms: Flax ``kernel``, ``bias`` (Dense, Conv) and
  ``scale`` (LayerNorm) one level or more below the root; not the root's ``cls_token``/``pos_embed``."""
  return len(path) >= 2 and path[-1] in ("kernel", "bias", "scale")


def symmetric_cross_entropy(student: Array, teacher: Array) -> Array:
  """Per-sample ``0.5 CE(teacher -> student) + 0.5 CE(student -> teacher)`` (the ImageNet ``softmax_entropy``).

  ``teacher`` is treated as a constant; the gradient reaches the student through both terms.
  """
  teacher = jax.lax.stop_gradient(teacher)
  log_s, log_t = jax.nn.log_softmax(student, -1), jax.nn.log_softmax(teacher, -1)
  return -0.5 * jnp.sum(jnp.exp(log_t) * log_s, -1) - 0.5 * jnp.sum(jnp.exp(log_s) * log_t, -1)


@dataclasses.dataclass(frozen=True)
class CoTTA(Method):
  name: ClassVar[str] = "cotta"
  cost: ClassVar[str] = "3F+1B (+32F)"  # student, anchor, plain teacher; 32 teacher forwards when triggered
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)

  lr: float = field(0.005, "> 0")  # FOA/SPA's ViT value, not scaled with the batch size
  momentum: float = field(0.9, "[0, 1)")
  nesterov: bool = False  # FOA/SPA; the official ResNet-50 config uses Nesterov
  mt: float = field(0.999, "[0, 1]")  # teacher EMA momentum (alpha_teacher)
  rst: float = field(0.001, "[0, 1]")  # stochastic restore probability per element
  # Augment when the batch mean of the anchor's max softmax probability is below this: above 1 on every batch,
  # 0 never (the official test is a plain `<`, any number).
  ap: float = field(0.1, ">= 0")
  n_aug: int = field(32, ">= 1")  # augmented views averaged by the teacher
  # views forwarded at once (lax.map batch_size); 1: one after the other, as the official
  aug_chunk: int = field(1, ">= 1")
  # the normalization of the step's images (augreg ViT: 0.5), one value per RGB channel (the augmentations')
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)
  augment_normalized: bool = False  # True: augment the normalized tensor, as FOA/SPA's ViT code does

  def __post_init__(self):
    super().__post_init__()
    if self.aug_chunk > self.n_aug:
      raise UserError(f"cotta aug_chunk: expected an integer from 1 to n_aug ({self.n_aug}), got {self.aug_chunk}")

  def prepare(self, model, params, rng, batch_size):
    _, source = split(params, is_weight_or_bias)
    tx = optax.sgd(self.lr, momentum=self.momentum or None, nesterov=self.nesterov)
    return Prepared(model, params, is_trainable=is_weight_or_bias, tx=tx, consts={"source": source})

  def init_extra(self, prep, trainable, opt_state):
    return CoTTAState(teacher=jax.tree.map(lambda x: jnp.array(x, copy=True), trainable))

  def restore_masks(self, key: Array, trainable: Params) -> Params:
    """Per element of every adapted param: True (back to source) with probability ``rst``."""
    leaves, treedef = jax.tree.flatten(trainable)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.bernoulli(k, self.rst, x.shape) for k, x in zip(keys, leaves)])

  def augment(self, key: Array, images: Array) -> Array:
    """One augmented view of the (normalized) batch, normalized; one random draw for the whole batch."""
    if self.augment_normalized:
      return cotta_augment(key, images)
    return normalize(cotta_augment(key, denormalize(images, self.mean, self.std)), self.mean, self.std)

  def update(self, prep, frozen, state, images, valid):
    rng, k_aug, k_rst = jax.random.split(state.rng, 3)
    masks = self.restore_masks(k_rst, state.trainable)
    view = lambda k: self.augment(k, images)
    return self.adapt(prep, frozen, state.replace(rng=rng), images, valid, view, jax.random.split(k_aug, self.n_aug),
                      masks)

  @staticmethod
  def select(to_aug: Array, averaged: Callable[[], Array], plain: Array) -> Array:
    """The teacher's prediction: ``averaged()`` (the views' forwards) only on the batches that trigger it."""
    return jax.lax.cond(to_aug, averaged, lambda: plain)

  def adapt(self, prep: Prepared, frozen: Params, state: AdaptState, images: Array, valid: Array,
            view: Callable[[Any], Array], seeds: Any, masks: Params) -> tuple[AdaptState, Array, dict[str, Array]]:
    """The step given its randomness: ``view(seed)`` makes one normalized view of ``images`` per entry of
    ``seeds`` (a leading axis of ``n_aug``: PRNG keys, or precomputed views with ``view`` the identity), and
    ``masks`` (the trainable tree, bool) marks the elements the stochastic restore resets."""
    teacher = state.extra.teacher
    source = prep.consts["source"]
    anchor_logits, _ = self.forward(prep, frozen, source, images)
    anchor_conf = losses.masked_mean(jnp.max(jax.nn.softmax(anchor_logits, -1), -1), valid)
    to_aug = anchor_conf < self.ap
    plain, _ = self.forward(prep, frozen, teacher, images)

    def averaged():
      one = lambda s: self.forward(prep, frozen, teacher, view(s))[0]
      return jnp.mean(jax.lax.map(one, seeds, batch_size=self.aug_chunk), axis=0)

    teacher_logits = self.select(to_aug, averaged, plain)

    def loss_fn(trainable):
      logits, _ = self.forward(prep, frozen, trainable, images)
      return losses.masked_mean(symmetric_cross_entropy(logits, teacher_logits), valid)

    loss, grads = jax.value_and_grad(loss_fn)(state.trainable)
    state = self.apply_gradients(prep, state, grads)
    teacher = jax.tree.map(lambda t, s: self.mt * t + (1 - self.mt) * s, teacher, state.trainable)
    trainable = jax.tree.map(jnp.where, masks, source, state.trainable)
    restored = sum(jnp.sum(m) for m in jax.tree.leaves(masks))
    state = state.replace(trainable=trainable, extra=CoTTAState(teacher=teacher), step=state.step + 1)
    metrics = {"loss": loss, "anchor_conf": anchor_conf, "augmented": to_aug.astype(jnp.int32),
               "restored": restored.astype(jnp.int32)}
    return state, teacher_logits, metrics
