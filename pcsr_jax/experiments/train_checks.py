"""What the training commands (`train_source`, `train_prompts`, `train_ddpm`) check, each as a one-line
`UserError`: their flags before any work, and their loss and params while they train.

Unchecked, a bad value surfaces late and as something else: a negative ``--seed`` as numpy's ``ValueError``
once the data is loaded, a zero ``--patch-size`` as a ``ZeroDivisionError``, an ``--lr`` of 1e30 as NaN params
written out as a finished model.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from pcsr_jax.errors import UserError

# `jax.random.key` keeps a seed's low 32 bits (without x64): seed 2**32 would start from seed 0's init.
SEED_MAX = 2 ** 32 - 1


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def check_flags(a: Any, positive: Sequence[str] = (), non_negative: Sequence[str] = (),
                positive_floats: Sequence[str] = (), non_negative_floats: Sequence[str] = ()) -> None:
  """``a.seed`` (parsed arguments) in ``[0, SEED_MAX]``, and each named attribute that was given (not None):
  ``positive`` integers >= 1, ``non_negative`` integers >= 0, ``positive_floats`` finite and > 0,
  ``non_negative_floats`` finite and >= 0; else a one-line `UserError` naming the flag."""
  if not 0 <= a.seed <= SEED_MAX:
    raise UserError(f"--seed: expected an integer in [0, {SEED_MAX}], got {a.seed}")
  for names, low in ((positive, 1), (non_negative, 0)):
    for name in names:
      v = getattr(a, name)
      if v is not None and v < low:
        kind = "a positive integer" if low else "an integer >= 0"
        raise UserError(f"{_flag(name)}: expected {kind}, got {v}")
  for names, strict in ((positive_floats, True), (non_negative_floats, False)):
    for name in names:
      v = getattr(a, name)
      if v is not None and not (math.isfinite(v) and (v > 0 if strict else v >= 0)):
        raise UserError(f"{_flag(name)}: expected a number {'>' if strict else '>='} 0, got {v}")


def finite(tree: Any) -> bool:
  """Whether every leaf of ``tree`` (arrays on the device or the host) is finite everywhere."""
  import jax
  import jax.numpy as jnp

  return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


def check_finite(step: int, lr: float, loss: float | None = None, params: Any = None) -> None:
  """Stops a diverging run, as the harness stops a diverging method: a non-finite ``loss`` of step ``step``
  (1-based), or a non-finite leaf of ``params`` after it, is a one-line `UserError` that names the step and
  asks for a lower ``--lr`` than ``lr``. Called before anything of the step is saved, so a diverged run is
  never written out as finished (nor its state saved for ``--resume``)."""
  if loss is not None and not math.isfinite(loss):
    what = f"loss ({loss})"
  elif params is not None and not finite(params):
    what = "parameters"
  else:
    return
  raise UserError(f"training diverged at step {step}: non-finite {what}; nothing was written as finished; try a "
                  f"lower --lr than {lr:g}")
