"""ZeroSiam (Chen et al., ICLR 2026): an asymmetric Siamese head, as in ``Cascol-Chen/ZeroSiam``.

``tta_library/zerosiam.py`` (class ``ZeroSiam``: ``forward_and_adapt``, ``cal_loss``,
``symmetric_kl_divergence``, ``collect_params``), ``models/byol_wrapper.py`` and ``main.py``'s ``zerosiam``
branch:

* Adapted: every LayerNorm's scale and bias (the final norm included) and a bias-free ``D x D`` *predictor*
  initialised to the identity, which sits between the final norm and the head (BYOLWrapper).
* One forward per batch: ``f`` is the final-norm class token; the target ``t = head(f)`` (detached) is also
  the reported prediction (before the update); the online branch is ``o = head(f @ P)``.
* Loss = the batch mean of the entropy of ``o`` + ``kl_weight`` (1) x the batch mean of the symmetric KL
  ``KL(p_t || p_o) + KL(p_o || p_t)`` (the code names it "js"), each summed over classes. Only ``t`` is
  detached, so both KL directions differentiate through ``o``; the LayerNorms get their gradient through
  ``f`` on the online branch. At the identity init the KL term is 0 and the first step is TENT's entropy
  through the predictor.
* Two SGDs, momentum 0.9: the LayerNorms at ``0.001 * B / 64 * lr_scale`` and the predictor at
  ``0.001 * B / 64 * lr_p``, both factors 5 for ViT-B (``main.sh``, README: 0.005 at B = 64; the argparse
  defaults are 1). The code doubles the base lr in its two batch-size-1 settings (``bs1``,
  ``label_shifts+bs1``); here at batch size 1 (its blind-spot setting, also at B = 1, does not double).
* No filter, no EMA, no reset; a new model and predictor per domain (the engine's reset).

The checkpoint's normalization (the official input pipeline, ``dataset/selectedRotateImageFolder.py``, was not
read). Padded rows are out of both batch means.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import group_sgd, sar_code_lr
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array

PREDICTOR = "zerosiam_predictor"  # {"kernel": [D, D]}: features @ kernel (torch: predictor.weight = kernel.T)
GROUPS = ("norm", "predictor")


def param_group(path) -> str:
  return "predictor" if path[0] == PREDICTOR else "norm"


def symmetric_kl(online: Array, target: Array) -> Array:
  """Per-sample ``KL(p_t || p_o) + KL(p_o || p_t)`` over the last axis (``symmetric_kl_divergence``)."""
  log_o, log_t = jax.nn.log_softmax(online, axis=-1), jax.nn.log_softmax(target, axis=-1)
  return jnp.sum((jnp.exp(log_t) - jnp.exp(log_o)) * (log_t - log_o), axis=-1)


@dataclasses.dataclass(frozen=True)
class ZeroSiam(Method):
  name: ClassVar[str] = "zerosiam"
  lr_scale: float = field(5.0, ">= 0")  # the LayerNorms' lr: 0.001 * B / 64 * lr_scale
  lr_p: float = field(5.0, ">= 0")  # the predictor's lr: 0.001 * B / 64 * lr_p
  lr: Optional[float] = field(None, "> 0")  # the base 0.001 * B / 64 (doubled at B = 1) when None
  momentum: float = field(0.9, "[0, 1)")
  kl_weight: float = field(1.0, ">= 0")  # alignment_weight

  def is_trainable(self, path) -> bool:
    return path[0] == PREDICTOR or is_layernorm_param(path)

  def prepare(self, model, params, rng, batch_size):
    c = model.config
    if c.num_classes == 0:
      raise UserError("zerosiam: the model needs a classification head (num_classes > 0)")
    base = self.lr if self.lr is not None else sar_code_lr(batch_size) * (2 if batch_size == 1 else 1)
    full = dict(params)
    full[PREDICTOR] = {"kernel": jnp.eye(c.embed_dim, dtype=jnp.float32)}
    tx = group_sgd({"norm": base * self.lr_scale, "predictor": base * self.lr_p}, self.momentum, param_group,
                   GROUPS)
    return Prepared(model, full, is_trainable=self.is_trainable, tx=tx)

  @staticmethod
  def forward(prep, frozen, trainable, images, collect=()):
    strip = lambda t: {k: v for k, v in t.items() if k != PREDICTOR}
    return Method.forward(prep, strip(frozen), strip(trainable), images, collect)

  def loss(self, prep: Prepared, frozen: Any, trainable: Any, images: Array, valid: Array
           ) -> tuple[Array, tuple[Array, Array]]:
    """``(loss, (target logits, symmetric KL per row))`` of the trainable params."""
    params = merge(frozen, trainable)
    kernel = params.pop(PREDICTOR)["kernel"]
    model = prep.model

    def both(x):
      f = model.apply({"params": params}, x, pre_logits=True)
      return (model.apply({"params": params}, f, method="classify"),
              model.apply({"params": params}, f @ kernel.astype(f.dtype), method="classify"))

    target, online = in_row_passes(prep, both, images)
    target = jax.lax.stop_gradient(target)
    kl = symmetric_kl(online, target)
    total = losses.masked_mean(losses.entropy(online), valid) + self.kl_weight * losses.masked_mean(kl, valid)
    return total, (target, kl)

  def update(self, prep, frozen, state, images, valid):
    (loss, (logits, kl)), grads = jax.value_and_grad(self.loss, argnums=2, has_aux=True)(
        prep, frozen, state.trainable, images, valid)
    state = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    return state, logits, {"loss": loss, "kl": losses.masked_mean(kl, valid)}
