"""PCSR as an online TTA method: recalibrators in, backbone frozen, eq. 9 as the loss.

* Trainable: only the DSN and FGN of every layer (`pcsr_jax.pcsr`); no
  gradient is taken for the backbone (``adapt_norms=True`` adds its LayerNorms).
* Loss (eq. 9): reliable entropy (mean entropy over the samples with
  ``ent < E0``, SAR's rule, eq. 8) + lambda * similarity loss (eq. 3), with
  lambda = (number of reliable samples) / B, a constant of the batch.
* Optimizer: SGD, two parameter groups -- DSN lr 0.2, FGN lr 0.0005 on
  ViT-B/16; 0.05 / 0.0001 on ViT-L/16 (`PCSR.preset`) -- momentum 0.9 (the
  paper says SGD; all related code uses momentum 0.9), no weight decay.
* Prediction: after the update (Algorithm 1: update, then output f(B_j)); the
  engine re-runs the forward. No SAR-style reset unless ``reset=True``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses, pcsr
from pcsr_jax.methods.base import Method, Prepared, is_layernorm_param, recover, sgd
from pcsr_jax.methods.tent import sar_code_lr
from pcsr_jax.models.vit import init_params


def is_recalibrator_param(path) -> bool:
  return path[0].startswith("recal_")


@dataclasses.dataclass(frozen=True)
class PCSR(Method):
  name: ClassVar[str] = "pcsr"
  default_eval_order: ClassVar[str] = "after"

  config: pcsr.PCSRConfig = pcsr.PCSRConfig()
  lr_dsn: float = 0.2
  lr_fgn: float = 0.0005
  momentum: float = 0.9
  adapt_norms: bool = False  # also adapt the backbone's LayerNorms (lr 0.001 * B / 64)
  reset: bool = False  # SAR-style recovery when the EMA of the reliable entropy drops below 0.2
  reset_constant: float = 0.2
  similarity_weight: float = 1.0  # scales eq. 9's lambda (1: the paper; 0: entropy only, an ablation)

  def __post_init__(self):
    if isinstance(self.config, dict):  # from JSON (--method-args)
      object.__setattr__(self, "config", pcsr.PCSRConfig.from_dict(self.config))

  @staticmethod
  def preset(arch: str, **overrides) -> "PCSR":
    """The paper's learning rates: ViT-B/16 0.2 / 0.0005; ViT-L/16 0.05 / 0.0001 (DSN / FGN)."""
    lrs = dict(lr_dsn=0.05, lr_fgn=0.0001) if arch.startswith("vit_large") else {}
    return PCSR(**{**lrs, **overrides})

  def is_trainable(self, path) -> bool:
    return is_recalibrator_param(path) or (self.adapt_norms and is_layernorm_param(path))

  def prepare(self, model, params, rng, batch_size):
    adapted = model.clone(recalibration=self.config)
    fresh = init_params(adapted, rng)
    full = dict(params)
    full.update({k: v for k, v in fresh.items() if is_recalibrator_param((k,))})

    def group(path):
      return pcsr.param_group(path) if is_recalibrator_param(path) else "norm"

    labels = lambda tree: jax.tree_util.tree_map_with_path(
        lambda kp, _: group(tuple(k.key for k in kp)), tree)
    tx = optax.multi_transform({"dsn": sgd(self.lr_dsn, self.momentum), "fgn": sgd(self.lr_fgn, self.momentum),
                                "norm": sgd(sar_code_lr(batch_size), self.momentum)}, labels)
    return Prepared(adapted, full, is_trainable=self.is_trainable, tx=tx, keeps_source=self.reset)

  def update(self, prep, frozen, state, images, valid):
    margin = self.margin(prep.model.config.num_classes)

    def loss_fn(trainable):
      logits, sown = self.forward(prep, frozen, trainable, images, collect=("losses",))
      ent = losses.entropy(logits)
      mask = losses.reliable_mask(ent, margin, valid)
      l_ent = losses.masked_mean(ent, mask)
      sims = jax.tree.leaves(sown.get("losses", {}))  # one [B] per layer call
      l_sim = losses.similarity_loss(jnp.stack(sims), valid) if sims else jnp.zeros(())
      lam = self.similarity_weight * jnp.sum(mask) / jnp.maximum(jnp.sum(valid), 1)  # eq. 9's lambda
      return l_ent + lam * l_sim, (logits, l_ent, l_sim, jnp.sum(mask))

    (loss, (logits, l_ent, l_sim, n_rel)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable)
    new = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    metrics = {"loss": loss, "entropy_loss": l_ent, "similarity_loss": l_sim, "num_reliable": n_rel}
    if self.reset:
      new, metrics["reset"] = recover(state, new, l_ent, n_rel > 0, threshold=self.reset_constant)
    return new, logits, metrics
