"""Online TTA methods, one file each, all implementing `base.Method`.

``get(name, **hyperparameters)`` builds one by name; to add a method, write a
`Method` subclass in a new file and add it to ``REGISTRY``.
"""

from __future__ import annotations

from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import AdaptState, Method, Prepared
from pcsr_jax.methods.pcsr import PCSR
from pcsr_jax.methods.sar import SAR
from pcsr_jax.methods.source import Source
from pcsr_jax.methods.tent import Tent

REGISTRY: dict[str, type[Method]] = {m.name: m for m in (Source, Tent, SAR, PCSR)}


def get(name: str, **hyperparameters) -> Method:
  """The method called ``name`` (source, tent, sar, pcsr) with the given hyperparameters."""
  if name not in REGISTRY:
    raise UserError(f"unknown method '{name}': expected one of {', '.join(REGISTRY)}")
  import dataclasses

  cls = REGISTRY[name]
  unknown = sorted(set(hyperparameters) - {f.name for f in dataclasses.fields(cls)})
  if unknown:
    raise UserError(f"{name}: unknown hyperparameters {unknown}")
  return cls(**hyperparameters)


__all__ = ["AdaptState", "Method", "PCSR", "Prepared", "REGISTRY", "SAR", "Source", "Tent", "get"]
