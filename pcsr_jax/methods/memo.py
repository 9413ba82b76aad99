"""MEMO (Zhang, Levine, Finn, NeurIPS 2022): marginal entropy over augmentations, one image at a time.

As ``zhangmarvin/memo:imagenet-exps/test_calls/test_adapt.py`` and ``utils/adapt_helpers.py`` run it with
the ViT-family setting (RVT*-small, ResNeXt-WSL: ``--optimizer adamw --lr 1e-5 --weight_decay 0.01``):

* Episodic: every test image starts from the source params; nothing carries over between images or batches.
* Adapted: all params. Loss: the entropy of the average softmax over ``views`` (64) augmented views of the
  image (``marginal_entropy``: per-view log-softmax, ``logsumexp`` over views minus ``log V``, clamped at the
  float32 minimum). Views: RandomResizedCrop + h-flip + AugMix (`pcsr_jax.augment.augmix_views`), never the
  clean image.
* One AdamW step (torch defaults betas (0.9, 0.999), eps 1e-8; decoupled decay ``p -= lr * wd * p`` on the
  pre-step param, which is what ``optax.adamw`` computes) from a fresh optimizer state, then the prediction is a
  forward of the clean image with the updated params. Cost per image: 64 forwards + 64 backwards + 1
  forward, i.e. "65F+64B" in batch-forward units.

The learning rate does not scale with the batch size: each image is its own batch of ``views`` views.

Eval order. MEMO's prediction is after its update by definition, but the update is per image: the params it
predicts with exist only inside `MEMO.update`, which returns those post-update logits. The state's trainable
params stay the source params, so the engine's "after" (a forward of ``state.trainable``) would be the source
model's prediction: it is not offered, and ``eval_orders = ("before",)`` names the only order the engine can
take, whose logits ARE the post-update predictions.

The per-image work (views -> gradients of all params -> one AdamW step -> clean forward) is ``jax.vmap``-ed
over ``chunk`` images at a time (``jax.lax.map`` over chunks bounds memory: each image in flight holds its
own copy of the gradients and params plus the activations of ``views`` forwards).

Deviations. The official script creates the AdamW optimizer once and never resets it, so its moments and
step count carry over from image to image while the weights are reloaded (with SGD and no momentum, the
ResNet setting, this makes no difference). Here every image starts from a fresh optimizer state, as DT's
``methods/memo.py`` (``reset()`` restores model and optimizer) and the paper's episodic description do.
The images arrive normalised; the views are built on ``denormalize(x, mean, std)`` and normalised back
(``mean``/``std``: the checkpoint's, default the augreg ViT's 0.5).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from pcsr_jax import augment
from pcsr_jax.methods.base import AdaptState, Method, Prepared
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import shard_rows

Array = jax.Array


def marginal_entropy(logits: Array) -> tuple[Array, Array]:
  """MEMO's loss for the ``[V, C]`` logits of one image's views: ``(entropy, log of the mean softmax)``."""
  log_p = jax.nn.log_softmax(logits, axis=-1)
  avg = jax.nn.logsumexp(log_p, axis=0) - math.log(logits.shape[0])
  avg = jnp.maximum(avg, jnp.finfo(avg.dtype).min)
  return -jnp.sum(avg * jnp.exp(avg), axis=-1), avg


@dataclasses.dataclass(frozen=True)
class MEMO(Method):
  name: ClassVar[str] = "memo"
  cost: ClassVar[str] = "65F+64B"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the logits `update` returns are post-update: see above

  lr: float = field(1e-5, "> 0")
  # AdamW's, with torch.optim.AdamW's ranges
  weight_decay: float = field(0.01, ">= 0")
  b1: float = field(0.9, "[0, 1)")
  b2: float = field(0.999, "[0, 1)")
  eps: float = field(1e-8, ">= 0")
  views: int = field(64, ">= 1")
  chunk: int = field(1, ">= 1")  # images adapted at once (vmapped); each holds its own gradients and params
  # the checkpoint's normalisation (augreg ViT), one value per RGB channel (AugMix's)
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)

  def prepare(self, model, params, rng, batch_size):
    tx = optax.adamw(self.lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
    return Prepared(model, params, is_trainable=lambda path: True, tx=tx)

  def draw_views(self, key: Array, image: Array, mesh: Optional[jax.sharding.Mesh] = None,
                 platform: str = "cpu") -> Array:
    """``[V, H, W, C]`` normalised AugMix views of one normalised ``[H, W, C]`` image (AugMix's chains looped
    on a CPU ``platform``, vectorised elsewhere: `augment.augmix_views`).

    On a mesh of several devices each device draws its own share of the views (``shard_map``; the same
    views as one device draws, from the same keys, up to float32 rounding: XLA may vectorise a device's
    share differently, 1.8e-7 seen at 2 views per device; ``tests/test_engine.py``), and they stay there for
    the model. Left to the partitioner, AugMix's loop of ``lax.switch`` ops compiled with collectives that two
    CPU devices entered in different orders (one waiting in an all-reduce, the other in an all-gather): a
    deadlock, seen with ``--row-chunk 16``.
    """
    x01 = augment.denormalize(image, self.mean, self.std)
    draw = lambda keys, img: augment.normalize(augment.augmix_views_of_keys(keys, img, platform=platform),
                                               self.mean, self.std)
    n = 1 if mesh is None else mesh.devices.size
    if n > 1 and self.views % n == 0:
      draw = jax.shard_map(draw, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    return draw(jax.random.split(key, self.views), x01)

  def adapted_params(self, prep: Prepared, frozen: Any, state: AdaptState, views: Array) -> tuple[Any, Array]:
    """One image's step on its ``[V, H, W, C]`` views from the source params and the fresh optimizer state
    (``state.opt_state``, which MEMO never advances): ``(adapted trainable params, loss)``."""

    # The views of the image in flight are the only batch axis the loop has: shard them over the devices (an
    # image's 64 views, 32 per device on two), or every device would run every view.
    views = shard_rows(prep, views)

    def loss_fn(trainable):
      logits, _ = self.forward(prep, frozen, trainable, views)
      return marginal_entropy(logits)[0]

    loss, grads = jax.value_and_grad(loss_fn)(state.trainable)
    updates, _ = prep.tx.update(grads, state.opt_state, state.trainable)
    return optax.apply_updates(state.trainable, updates), loss

  def adapt_one(self, prep: Prepared, frozen: Any, state: AdaptState, image: Array,
                views: Array) -> tuple[Array, Array]:
    """One image: `adapted_params`, then the clean ``[H, W, C]`` image's logits. ``(logits [C], loss)``."""
    adapted, loss = self.adapted_params(prep, frozen, state, views)
    logits, _ = self.forward(prep, frozen, adapted, image[None])
    return logits[0], loss

  def _map(self, state: AdaptState, valid: Array, one: Callable[[Any], tuple[Array, Array]],
           xs: Any) -> tuple[AdaptState, Array, dict[str, Array]]:
    """``one`` over the images, ``chunk`` at a time. Padded rows are adapted too (fixed shapes) but change
    nothing and are left out of the loss metric."""
    b = valid.shape[0]
    # One image at a time is a plain loop, not a vmap of one: under vmap the AugMix ops' `lax.switch`
    # would turn into a select that computes every op (`augment.augmix_views`).
    chunk = min(self.chunk, b)
    logits, loss = jax.lax.map(one, xs) if chunk == 1 else jax.lax.map(one, xs, batch_size=chunk)
    metrics = {"loss": jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(jnp.sum(valid), 1)}
    return state.replace(step=state.step + 1), logits, metrics

  def adapt(self, prep: Prepared, frozen: Any, state: AdaptState, images: Array, valid: Array,
            views: Array) -> tuple[AdaptState, Array, dict[str, Array]]:
    """The step on given normalised views ``[B, V, H, W, C]`` (tests pass fixed ones)."""
    one = lambda xv: self.adapt_one(prep, frozen, state, *xv)
    return self._map(state, valid, one, (images, views))

  def update(self, prep, frozen, state, images, valid):
    rng, key = jax.random.split(state.rng)
    keys = jax.random.split(key, images.shape[0])
    # Views are drawn inside the map, so only the images in flight hold theirs ([chunk, V, H, W, C]).
    one = lambda xk: self.adapt_one(prep, frozen, state, xk[0], self.draw_views(xk[1], xk[0], prep.mesh,
                                                                                         prep.platform))
    return self._map(state.replace(rng=rng), valid, one, (images, keys))
