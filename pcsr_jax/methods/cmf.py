"""CMF (Lee & Chang, ICLR 2024): continual momentum filtering, as in DT's ``classification/methods/cmf.py``.

DT's CMF (adapted from the OpenReview supplementary; ``conf.py`` CMF block, ``cfgs/imagenet_c/cmf.yaml``)
is ROID's loss, sample weights, consistency, optimizer and prior correction (`pcsr_jax.methods.roid`)
with ROID's fixed source ensembling replaced by a Kalman-style filter over three models: the source, the
target (the one trained) and a hidden model. After each SGD step (``bayesian_filtering``, in this order):

1. predict: ``hidden <- alpha * hidden + (1 - alpha) * source``;
2. ``var <- alpha^2 * var + q``; gain ``beta = (1 - q) / (var + 1 - q)``, raised to 0.89 if not above it,
   and set to 1 if not below 0.9999; ``var <- beta * var``; ``hidden <- beta * hidden + (1 - beta) *
   target`` (the hidden model of step 1 updated in place);
3. ``target <- gamma * target + (1 - gamma) * hidden`` (trainable params only).

alpha = gamma = 0.99, ``q = 0.005 * (#trainable / 38400)`` (0.005 for ViT-B/16's 25 LayerNorms). The
hidden model starts as the source and ``var`` at 0. DT's hidden model holds every param, but only the
trainable ones ever differ from the source (the others are averages of equal values), so only those are
carried. ``var`` and ``beta`` are float32 here, Python floats in DT.

A reset between domains (DT's ``reset()``, called before each corruption in ``reset_each_shift``) reloads
the three models, the optimizer and ROID's class-probability EMA, but not ``hidden_var``: the filter's
variance carries from one corruption to the next (the first starts at 0). So does ``var`` here
(`Method.extra_after_reset`, `engine.Adapter.reset`); ``keep_var_on_reset=False`` restarts it at 0 with the
rest, this project's behaviour before it followed the code (and what reset per corruption suggests).

DT's ``CMF.TYPE = "op"`` meant to merge the *predicted* hidden model in step 3, but ``ema_update_model``
updates in place and returns its argument, so it merges the updated one as ``"lp"`` does: one form only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax
import jax
import jax.numpy as jnp

from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.roid import ROIDBase, ema

Array = jax.Array

PARAMS_REFERENCE = 38400  # DT: q is scaled by #trainable / 38400 (ViT-B/16's LayerNorm params)


@flax.struct.dataclass
class CMFState:
  """ROID's state (`ROIDState`) plus the hidden model's trainable params and the filter's variance."""

  probs_ema: Array
  source: Any
  hidden: Any
  var: Array


@dataclasses.dataclass(frozen=True)
class CMF(ROIDBase):
  name: ClassVar[str] = "cmf"
  alpha: float = field(0.99, "[0, 1]")  # hidden-model prediction towards the source
  gamma: float = field(0.99, "[0, 1]")  # target <- gamma target + (1 - gamma) hidden
  q: float = field(0.005, ">= 0")  # process noise for #trainable = 38400; scaled by #trainable / 38400
  keep_var_on_reset: bool = True  # DT's reset() keeps hidden_var across domains; False: back to 0

  def init_extra(self, prep, trainable, opt_state):
    base = super().init_extra(prep, trainable, opt_state)
    return CMFState(probs_ema=base.probs_ema, source=base.source, hidden=jax.tree.map(jnp.array, trainable),
                    var=jnp.zeros((), jnp.float32))

  def extra_after_reset(self, fresh, previous):
    """DT's ``reset()``: everything from the source but the filter's variance (module doc)."""
    return fresh.replace(var=previous.var) if self.keep_var_on_reset else fresh

  def process_noise(self, trainable) -> float:
    """DT's ``q = CMF.Q * num_trainable_params / 38400``."""
    return self.q * sum(x.size for x in jax.tree.leaves(trainable)) / PARAMS_REFERENCE

  def merge(self, extra, trainable):
    """DT's ``bayesian_filtering`` (module doc), after the SGD step."""
    q = self.process_noise(trainable)
    hidden = ema(extra.hidden, extra.source, self.alpha)  # 1. predict
    var = self.alpha**2 * extra.var + q  # 2. update
    r = 1.0 - q
    beta = r / (var + r)
    beta = jnp.where(beta > 0.89, beta, 0.89)
    beta = jnp.where(beta < 0.9999, beta, 1.0)
    var = beta * var
    hidden = ema(hidden, trainable, beta)
    trainable = ema(trainable, hidden, self.gamma)  # 3. parameter ensemble
    return extra.replace(hidden=hidden, var=var), trainable, {"beta": beta, "var": var}
