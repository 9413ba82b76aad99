"""The registered methods' names without importing them: what a command checks ``--methods`` against before it
imports jax, flax or the methods (a misspelled name answers in a fraction of a second, with the nearest names).

`NAMES` is `pcsr_jax.methods.REGISTRY`'s keys in order; ``tests/test_methods.py`` keeps the two equal. Imports
nothing of pcsr_jax but `errors`.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence

from pcsr_jax.errors import UserError

NAMES: tuple[str, ...] = (
    "source", "tent", "sar", "cotta", "memo", "adacontrast", "pcsr", "pcsr-frozen", "t3a", "eta", "eata", "deyo",
    "cfa", "foa", "spa", "roid", "cmf", "dept-g", "dda", "tent-come", "sar-come", "eata-come", "vct", "dct", "dpal",
    "zerosiam", "rem", "dpcore", "neo", "pea", "imse", "fozo",
)


def did_you_mean(name: str, names: Sequence[str] = NAMES) -> str:
  """`` (did you mean a, b?)`` with the names nearest to ``name``, or "" when none is near."""
  near = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
  return f" (did you mean {' or '.join(near)}?)" if near else ""


def check(given: Iterable[str], names: Sequence[str] = NAMES, flag: str = "--methods") -> None:
  """One line naming ``flag``, the first unknown name, its nearest names and every name, if any of ``given`` is
  not among ``names``. A ``package.module:Class`` spec (`pcsr_jax.methods.load`) is left to its import."""
  for m in given:
    if ":" not in m and m not in names:
      raise UserError(f"{flag}: unknown method '{m}'{did_you_mean(m, names)}; expected some of {', '.join(names)}")
