"""SPA (Niu et al., ICML 2025): self-bootstrapping, as in ``mr-eggplant/SPA``.

``tta_library/spa.py``, ``models/byol_wrapper.py``, ``models/maskers.py`` and ``main.py``:

* Adapted: every LayerNorm's scale and bias (``collect_params``: all ``nn.LayerNorm`` of the model,
  the final norm included), a bias-free ``D x D`` *predictor* initialised to the identity
  (``BYOLWrapper``), and the learnable per-patch noise strengths ``alpha`` (``LearnablePatchErasing``:
  one per 16 x 16 patch, ``(H / 16)^2`` = 196 at 224, initialised to ``sqrt(noise_ratio)``).
* The predictor acts only on the augmented views, between the final norm and the head: BYOLWrapper's
  ``use_predictor=True`` path is ``head(predictor(fc_norm(forward_features(x)[:, 0])))``, where
  ``forward_features`` ends with the final norm and ``fc_norm`` is the identity for class-token ViTs.
* Per batch (3 forwards, 1 backward through the two augmented forwards): the original forward gives
  the reported prediction and the (detached) targets. Two views of the *normalised* input:
  low-frequency amplitude masking (`pcsr_jax.augment.spa_amplitude_mask`: the central 0.2-sized block
  of the amplitude spectrum kept element-wise with ``1 - freq_mask_ratio`` = 0.8) and per-patch noise
  mixing (`pcsr_jax.augment.spa_patch_noise` with the learnable ``alpha``, clipped to the pixel range).
  For each view, ``KLDivLoss(reduction='batchmean')(log_softmax(aug), softmax(orig).detach())`` over
  the samples whose original confidence (max softmax) is strictly above the view's: the mean over the
  *selected* samples (none selected: 0, the official's NaN loss with zero gradients). Loss = the sum
  over the two views (+ ``tent_weight`` x the mean entropy of the original forward: SPA+Tent, whose
  official weight is 0.1; the gradient then also flows through the original forward).
* Optimizers (``main.py``, ViT-B): SGD with momentum 0.9, lr 0.01 for the LayerNorms and 0.05 for the
  predictor; a second SGD (lr 1, momentum 0.9) on ``alpha`` with the gradient negated (gradient
  *ascent*: the noise learns to be as disruptive as possible). The learning rates are fixed, not scaled
  with the batch size (``main.py`` uses them for every batch size). After the step ``alpha`` is rescaled
  so that ``mean(alpha^2) = noise_ratio`` and clipped to [-1, 1] (``fix_patch_alpha``).
* Prediction: the original forward, before the update (``eval_order='after'`` re-runs the plain
  forward, without the predictor, with the updated LayerNorms). A domain reset (the engine's fresh
  state) restores the model, the predictor, ``alpha`` and both optimizers, as ``SPA.reset``.

The step receives normalised images, as the official model input (mean = std = 0.5 there, so the
noisy view's [-1, 1] clip is the pixel range [0, 1]). Here the clip bounds are the pixel range under
the ``mean``/``std`` fields (default the 0.5 of the augreg ViTs, which the lead wires to the
checkpoint's): with the defaults they are exactly the official [-1, 1].

Padded rows are excluded from the selections and the means; the views are per sample (the one noise
draw shared by the batch, as the official, mixes no samples), so padding changes nothing.
Deviations: JAX's random numbers for the masks and the noise; the official ``imagenet_mask``
(ImageNet-R/-A) is the model's ``class_subset``, applied after the head as there. Not implemented: the
official SPA+ETA and SPA+EATA auxiliary losses ("SPA*" with ETA's filters or EATA's Fisher).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pcsr_jax import losses
from pcsr_jax.augment import spa_amplitude_mask, spa_patch_noise
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import group_sgd, parallel
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array

PREDICTOR = "spa_predictor"  # {"kernel": [D, D]}: features @ kernel (torch: predictor.weight = kernel.T)
NOISE = "spa_noise"  # {"alpha": [(H / p) * (W / p)]}: the learnable patch-noise strengths
GROUPS = ("norm", "predictor", "noise")


def param_group(path) -> str:
  """'predictor', 'noise', or 'norm' (the model's LayerNorms)."""
  return {PREDICTOR: "predictor", NOISE: "noise"}.get(path[0], "norm")


def model_params(params: Any) -> Any:
  """The model's params without SPA's own (predictor and noise strengths)."""
  return {k: v for k, v in params.items() if k not in (PREDICTOR, NOISE)}


def apply_with_predictor(model: nn.Module, params: Any, kernel: Array, images: Array) -> Array:
  """Logits of BYOLWrapper's ``use_predictor=True`` path: the head applied to ``feature @ kernel``.

  The head's input is the final-norm class token (``pre_logits``), so the predictor sits exactly between
  the final norm and the head; `classify` then applies the head and a ``class_subset``, as the official
  ``imagenet_mask``.
  """
  z = model.apply({"params": params}, images, pre_logits=True)
  return model.apply({"params": params}, z @ kernel.astype(z.dtype), method="classify")


def renormalize_strengths(alpha: Array, noise_ratio: float) -> Array:
  """``fix_patch_alpha``: rescale so that ``mean(alpha^2) = noise_ratio``, then clip to [-1, 1]."""
  alpha = alpha / jnp.sqrt(jnp.mean(jnp.square(alpha)) / noise_ratio)
  return jnp.clip(alpha, -1.0, 1.0)


def consistency_loss(orig_logits: Array, aug_logits: Array, valid: Array) -> tuple[Array, Array]:
  """``get_low_consist_loss``: ``(loss, selected)``.

  ``selected`` = valid rows whose original max-softmax is strictly above the augmented one;
  ``loss`` = mean over them of KL(softmax(orig) || softmax(aug)), the original detached (0 if none).
  """
  orig_logits = jax.lax.stop_gradient(orig_logits)
  conf = jnp.max(jax.nn.softmax(orig_logits, axis=-1), axis=-1)
  aug_conf = jnp.max(jax.nn.softmax(jax.lax.stop_gradient(aug_logits), axis=-1), axis=-1)
  selected = valid & (conf > aug_conf)
  log_p = jax.nn.log_softmax(orig_logits, axis=-1)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(aug_logits, axis=-1)), axis=-1)
  return losses.masked_mean(kl, selected), selected


@dataclasses.dataclass(frozen=True)
class SPA(Method):
  name: ClassVar[str] = "spa"
  cost: ClassVar[str] = "3F+1B"

  # Learning rates of the three groups; 0 leaves a group as it is.
  lr_norm: float = field(0.01, ">= 0")
  lr_predictor: float = field(0.05, ">= 0")
  lr_noise: float = field(1.0, ">= 0")  # the strengths' own SGD, by gradient ascent
  momentum: float = field(0.9, "[0, 1)")  # both optimizers
  noise_ratio: float = field(0.4, "(0, 1]")  # the strengths' mean alpha^2 (init sqrt(0.4) each)
  # LearnablePatchErasing(patch_size=16), independent of the model's patch size
  noise_patch: int = field(16, ">= 1")
  freq_mask_ratio: float = field(0.2, "[0, 1)")  # low frequencies are kept with 1 - 0.2
  low_freq_ratio: float = field(0.2, "(0, 1]")  # side of the central low-frequency block (Prompt(prompt_alpha=0.2))
  tent_weight: float = field(0.0, ">= 0")  # SPA+Tent: 0.1
  # the input normalisation (for the pixel-range clip), one value per channel of the model's input
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5))
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0")

  def is_trainable(self, path) -> bool:
    return path[0] in (PREDICTOR, NOISE) or is_layernorm_param(path)

  def prepare(self, model, params, rng, batch_size):
    c = model.config
    if c.img_size % self.noise_patch:
      raise UserError(f"spa noise_patch: expected a divisor of the image size {c.img_size}, got {self.noise_patch}")
    if c.num_classes == 0:
      raise UserError("spa: the model needs a classification head (num_classes > 0)")
    if len(self.mean) != c.in_chans:
      raise UserError(f"spa mean/std: expected {c.in_chans} values, got {len(self.mean)}")
    n = (c.img_size // self.noise_patch) ** 2
    full = dict(params)
    full[PREDICTOR] = {"kernel": jnp.eye(c.embed_dim, dtype=jnp.float32)}
    full[NOISE] = {"alpha": jnp.full((n,), np.sqrt(self.noise_ratio), jnp.float32)}
    parts = {"model": group_sgd({"norm": self.lr_norm, "predictor": self.lr_predictor}, self.momentum, param_group,
                                GROUPS),
             "noise": group_sgd({"noise": self.lr_noise}, self.momentum, param_group, GROUPS)}
    return Prepared(model, full, is_trainable=self.is_trainable, tx=parallel(**parts), parts=parts)

  @staticmethod
  def forward(prep, frozen, trainable, images, collect=()):
    return Method.forward(prep, model_params(frozen), model_params(trainable), images, collect)

  def pixel_bounds(self) -> tuple[Array, Array]:
    """The normalised values of pixels 0 and 1 per channel (the official [-1, 1] under 0.5 / 0.5)."""
    mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
    return jnp.asarray((0.0 - mean) / std), jnp.asarray((1.0 - mean) / std)

  def masked_view(self, key: Array, images: Array) -> Array:
    """The low-frequency amplitude-masked view (``Prompt.masking``)."""
    return spa_amplitude_mask(key, images, keep_prob=1.0 - self.freq_mask_ratio, ratio=self.low_freq_ratio)

  def noisy_view(self, key: Array, images: Array, alpha: Array) -> Array:
    """The patch-noise view (``LearnablePatchErasing``), differentiable in ``alpha``."""
    return spa_patch_noise(key, images, alpha, self.noise_patch, self.pixel_bounds())

  def loss(self, prep: Prepared, frozen: Any, trainable: Any, images: Array, valid: Array, masked: Array,
           noise_key: Array, logits: Any = None) -> tuple[Array, tuple]:
    """SPA's loss of the trainable params: ``(loss, (logits, losses per view, selections per view))``.

    ``logits`` is the original forward, computed here (with its gradient) when None.
    """
    params = merge(model_params(frozen), trainable)
    mparams = model_params(params)
    if logits is None:
      logits = in_row_passes(prep, lambda x: prep.model.apply({"params": mparams}, x), images)
    noisy = self.noisy_view(noise_key, images, params[NOISE]["alpha"])
    kernel = params[PREDICTOR]["kernel"]
    aug = in_row_passes(prep, lambda x: apply_with_predictor(prep.model, mparams, kernel, x),
                        jnp.concatenate([masked, noisy]))
    b = images.shape[0]
    l_mask, s_mask = consistency_loss(logits, aug[:b], valid)
    l_noise, s_noise = consistency_loss(logits, aug[b:], valid)
    total = l_mask + l_noise
    if self.tent_weight:
      total = total + self.tent_weight * losses.masked_mean(losses.entropy(logits), valid)
    return total, (logits, (l_mask, l_noise), (s_mask, s_noise))

  def update(self, prep, frozen, state, images, valid):
    rng, k_mask, k_noise = jax.random.split(state.rng, 3)
    masked = self.masked_view(k_mask, images)
    state, logits, metrics = self.adapt(prep, frozen, state.replace(rng=rng), images, valid, masked, k_noise)
    return state, logits, metrics

  def adapt(self, prep: Prepared, frozen: Any, state: Any, images: Array, valid: Array, masked: Array,
            noise_key: Array) -> tuple[Any, Array, dict[str, Array]]:
    """The step given the amplitude-masked view ``masked`` and the key of the patch noise (tests inject both)."""
    logits = None
    if not self.tent_weight:  # the original forward only gives detached targets: no backward through it
      logits, _ = self.forward(prep, frozen, state.trainable, images)
    grad_fn = jax.value_and_grad(self.loss, argnums=2, has_aux=True)
    (loss, (logits, (l_mask, l_noise), (s_mask, s_noise))), grads = grad_fn(
        prep, frozen, state.trainable, images, valid, masked, noise_key, logits)
    # Gradient ascent on the noise strengths (the official negates alpha.grad before its optimizer's step).
    grads = {k: jax.tree.map(jnp.negative, v) if k == NOISE else v for k, v in grads.items()}
    state = self.apply_gradients(prep, state, grads)
    trainable = dict(state.trainable)
    trainable[NOISE] = {"alpha": renormalize_strengths(trainable[NOISE]["alpha"], self.noise_ratio)}
    state = state.replace(trainable=trainable, step=state.step + 1)
    metrics = {"loss": loss, "loss_mask": l_mask, "loss_noise": l_noise, "num_selected_mask": jnp.sum(s_mask),
               "num_selected_noise": jnp.sum(s_noise)}
    return state, logits, metrics
