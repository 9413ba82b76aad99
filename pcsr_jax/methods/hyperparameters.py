"""A method's hyperparameters declared with the values they accept (`field`), and their checks: a wrong type or
a value out of range is one line, ``<method> <field>: expected ..., got ...`` (`tests/test_hyperparameters.py`
walks every field of every method)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from typing import Any, Optional

from pcsr_jax.errors import UserError


def field(default: Any, check: Any = None, *, size: Optional[int] = None) -> Any:
  """A method's hyperparameter declared with the values it accepts, which `Method.__post_init__` checks (so
  ``methods.get`` and direct construction refuse alike, in one line: ``<method> <field>: expected ..., got ...``).

  ``check`` is a range as text: ``"> 0"``, ``">= 0"``, ``"[0, 1]"``, ``"[0, 1)"``, ``"(0, 1]"`` (an int or float
  field's value, a tuple field's every element), or a tuple of the allowed values (a str field); None: any finite
  value. ``size``: the exact length of a tuple field. Besides: an int field takes ints, a float field ints and
  floats, all finite (tuple elements too), and an ``Optional`` field also None.
  """
  return dataclasses.field(default=default, metadata={"check": check, "size": size})


_RANGE = re.compile(r"^(?:(>=|>)\s*(\S+)|([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])]))$")


@dataclasses.dataclass(frozen=True)
class Spec:
  """What one hyperparameter accepts (`field`): ``kind`` is 'int', 'float', 'str' or 'bool' (a tuple's elements
  when ``is_tuple``)."""

  name: str
  kind: str
  is_tuple: bool = False
  optional: bool = False
  check: Any = None
  size: Optional[int] = None

  def bounds(self) -> tuple[float, float, bool, bool]:
    """``(lo, hi, lo_open, hi_open)`` of a range check."""
    m = _RANGE.match(self.check.strip())
    if m is None:
      raise ValueError(f"{self.name}: not a range: {self.check!r}")
    if m.group(1):
      return float(m.group(2)), math.inf, m.group(1) == ">", True
    return float(m.group(4)), float(m.group(5)), m.group(3) == "(", m.group(6) == ")"

  def describe(self) -> str:
    if isinstance(self.check, tuple):
      return "one of " + ", ".join(map(str, self.check))
    what = {"int": "integer", "float": "number", "str": "string"}.get(self.kind, self.kind)
    rng = ""
    if self.check is not None:
      lo, hi, lo_open, hi_open = self.bounds()
      if hi == math.inf:
        rng = f" {'>' if lo_open else '>='} {lo:g}"
      else:
        rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if self.is_tuple:
      text = f"{self.size if self.size is not None else 'a tuple of'} {what}s{rng}"
    else:
      text = f"{'an' if what[0] in 'aeiou' else 'a'} {what}{rng}"
    if self.kind == "float" and self.check is None:
      text = text.replace("number", "finite number")
    return ("None or " if self.optional else "") + text

  def accepts(self, value: Any) -> bool:
    if value is None:
      return self.optional
    if self.is_tuple:
      return (isinstance(value, tuple) and (self.size is None or len(value) == self.size)
              and all(self._accepts_one(v) for v in value))
    return self._accepts_one(value)

  def _accepts_one(self, v: Any) -> bool:
    if self.kind in ("int", "float"):
      number = int if self.kind == "int" else (int, float)
      if isinstance(v, bool) or not isinstance(v, number) or not math.isfinite(v):
        return False
      if self.check is None:
        return True
      lo, hi, lo_open, hi_open = self.bounds()
      return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if self.kind == "str" and not isinstance(v, str):
      return False
    if isinstance(self.check, tuple):
      return v in self.check
    return True


@functools.cache
def specs(cls: type) -> tuple[Spec, ...]:
  """The `Spec` of every hyperparameter of method class ``cls`` declared with `field`."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if "check" not in f.metadata:
      continue
    t = hints[f.name]
    optional = typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)
    if optional:
      t = next(a for a in typing.get_args(t) if a is not type(None))
    is_tuple = typing.get_origin(t) is tuple
    if is_tuple:
      t = typing.get_args(t)[0]
    out.append(Spec(f.name, t.__name__, is_tuple, optional, f.metadata["check"], f.metadata["size"]))
  return tuple(out)


def check_hyperparameters(method: Any) -> None:
  """One-line `UserError` for the first hyperparameter of ``method`` outside what its `field` declares, then for
  the rules that tie fields together in every method that has them: a ``mean`` and a ``std`` per channel, a kNN
  bank that holds at least ``num_neighbors`` entries, and Nesterov only with momentum (as ``torch.optim.SGD``)."""
  for spec in specs(type(method)):
    value = getattr(method, spec.name)
    if not spec.accepts(value):
      raise UserError(f"{method.name} {spec.name}: expected {spec.describe()}, got {value!r}")
  mean, std = getattr(method, "mean", None), getattr(method, "std", None)
  if mean is not None and std is not None and (not mean or len(mean) != len(std)):
    raise UserError(f"{method.name} mean/std: expected one mean and one std per channel, got {mean} and {std}")
  queue, neighbors = getattr(method, "queue_size", None), getattr(method, "num_neighbors", None)
  if queue is not None and neighbors is not None and queue < neighbors:  # a kNN bank (AdaContrast, DePT-G)
    raise UserError(f"{method.name} queue_size: expected at least num_neighbors ({neighbors}), got {queue}")
  if getattr(method, "nesterov", False) and getattr(method, "momentum", None) == 0:
    raise UserError(f"{method.name} nesterov: expected momentum > 0 with Nesterov (as torch.optim.SGD)")
