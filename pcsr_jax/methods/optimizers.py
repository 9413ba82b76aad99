"""The optimizers of the official codes, written with optax: PyTorch's SGD (one or several learning rates),
several optimizers over one param tree, SAM's perturbation, and SAR's model recovery (its EMA and reset)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from pcsr_jax.methods.state import AdaptState

Array = jax.Array
Params = Any
Path = tuple[str, ...]


@flax.struct.dataclass
class Recovery:
  """SAR's model recovery state: the EMA of the second-pass loss (``valid`` False = PyTorch's ``None``) and
  the trainable params and optimizer state a reset returns to."""

  ema: Array
  valid: Array
  source: Any

  @staticmethod
  def init(trainable: Params, opt_state: Any) -> "Recovery":
    return Recovery(ema=jnp.zeros((), jnp.float32), valid=jnp.zeros((), bool), source=(trainable, opt_state))


def sgd(lr: float, momentum: float) -> optax.GradientTransformation:
  """PyTorch's SGD (dampening 0, no Nesterov, no weight decay): buf = m*buf + g; p -= lr*buf."""
  return optax.sgd(lr, momentum=momentum if momentum else None)


def tree_where(cond: Array, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def group_sgd(lrs: Mapping[str, float], momentum: float, label: Callable[[Path], str],
              groups: tuple[str, ...]) -> optax.GradientTransformation:
  """PyTorch SGD with one learning rate per parameter group, over a tree that holds every group.

  ``label(path)`` names a parameter's group; groups in ``groups`` but not in ``lrs`` get a zero update
  and carry no optimizer state (they belong to another optimizer of the same method).
  """
  labels = lambda tree: jax.tree_util.tree_map_with_path(lambda kp, _: label(tuple(k.key for k in kp)), tree)
  return optax.multi_transform({g: sgd(lrs[g], momentum) if g in lrs else optax.set_to_zero() for g in groups},
                               labels)


def parallel(**txs: optax.GradientTransformation) -> optax.GradientTransformation:
  """Several optimizers over one param tree, each with its own state: ``{name: state}``.

  This is the shape of PyTorch code that holds two optimizers (DPAL's SAM and its plain SGD): a method steps
  the parts separately (`Prepared.parts`); ``update`` steps them all with the same gradients.
  """

  def init(params):
    return {k: tx.init(params) for k, tx in txs.items()}

  def update(grads, state, params=None):
    total, new = None, {}
    for k, tx in txs.items():
      u, new[k] = tx.update(grads, state[k], params)
      total = u if total is None else jax.tree.map(jnp.add, total, u)
    return total, new

  return optax.GradientTransformation(init, update)


RESET_OPTIMIZER = ("official", "all")


def recover(old: AdaptState, new: AdaptState, loss: Array, has_loss: Array, decay: float = 0.9,
            threshold: float = 0.2, clear_ema: bool = False, opt_on_reset: Any = None) -> tuple[AdaptState, Array]:
  """SAR's model recovery on the state after an update; returns ``(state, reset)``.

  ``ema = decay * ema + (1 - decay) * loss`` (the first loss initializes it; a
  batch without a loss, ``has_loss`` False, leaves it alone). If ``ema <
  threshold`` the trainable params go back to ``old.extra.source[0]`` (a
  `Recovery`) and the optimizer state to ``opt_on_reset``: by default ``old.extra.source[1]``, the
  initial state ("clear everything"). The official code restores only what its
  ``optimizer.load_state_dict`` calls restore: a method passes the state that
  results (for SAM, ``new.opt_state`` itself: the momentum lives in SAM's inner
  SGD, whose state SAM's ``state_dict`` does not hold). ``clear_ema`` forgets
  the EMA on a reset.
  """
  rec = old.extra
  ema = jnp.where(rec.valid, decay * rec.ema + (1 - decay) * loss, loss)
  ema = jnp.where(has_loss, ema, rec.ema)
  valid = rec.valid | has_loss
  reset = valid & (ema < threshold)
  if clear_ema:
    valid = valid & ~reset
  opt_on_reset = rec.source[1] if opt_on_reset is None else opt_on_reset
  state = new.replace(trainable=tree_where(reset, rec.source[0], new.trainable),
                      opt_state=tree_where(reset, opt_on_reset, new.opt_state),
                      extra=rec.replace(ema=ema, valid=valid), resets=old.resets + reset.astype(jnp.int32))
  return state, reset


def sam_perturb(params: Params, grads: Params, rho: float, include: Callable[[Path], bool] = lambda p: True
                ) -> Params:
  """SAM's first step: ``p + rho * g / (||g|| + 1e-12)`` for the params SAM holds (``include``).

  The norm is the global L2 norm over exactly those params' gradients (SAM's ``_grad_norm`` over its
  param groups); the others are returned unchanged.
  """
  flat_p, flat_g = traverse_util.flatten_dict(params), traverse_util.flatten_dict(grads)
  held = [k for k in flat_p if include(k)]
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(flat_g[k])) for k in held))
  scale = rho / (grad_norm + 1e-12)
  return traverse_util.unflatten_dict({k: p + flat_g[k] * scale if k in held else p for k, p in flat_p.items()})


def sar_code_lr(batch_size: int) -> float:
  """SAR's learning rate for the LayerNorms of timm ViTs: 0.001 * B / 64 (TENT, SAR, DCT, PCSR's base)."""
  return 0.001 * batch_size / 64
