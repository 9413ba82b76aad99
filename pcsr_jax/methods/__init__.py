"""Online TTA methods, one file each, all implementing `base.Method`.

``get(name, **hyperparameters)`` builds one by its registry name. A registry
entry is a `Method` class and the overrides that make a variant of it
(``pcsr-frozen`` is `PCSR` with ``recipe='frozen'``), so variants run side by
side under their own names. To add a method, write a `Method` subclass in a
new file and add a line to ``REGISTRY``.
"""

from __future__ import annotations

from pcsr_jax.errors import UserError, check_fields
from pcsr_jax.methods.base import AdaptState, Method, Prepared
from pcsr_jax.methods.pcsr import PCSR
from pcsr_jax.methods.sar import SAR
from pcsr_jax.methods.source import Source
from pcsr_jax.methods.tent import Tent

REGISTRY: dict[str, tuple[type[Method], dict]] = {
    "source": (Source, {}),
    "tent": (Tent, {}),
    "sar": (SAR, {}),
    "pcsr": (PCSR, {}),  # the authors' recipe: SAR's base + PCSR's modules
    "pcsr-frozen": (PCSR, {"recipe": "frozen"}),  # the paper's text alone: backbone frozen, plain SGD
}


def get(name: str, **hyperparameters) -> Method:
  """The method registered as ``name`` with the given hyperparameters (over the variant's overrides)."""
  if name not in REGISTRY:
    raise UserError(f"unknown method '{name}': expected one of {', '.join(REGISTRY)}")
  cls, overrides = REGISTRY[name]
  check_fields(cls, hyperparameters, name, "unknown hyperparameters")
  return cls(**{**overrides, **hyperparameters})


__all__ = ["AdaptState", "Method", "PCSR", "Prepared", "REGISTRY", "SAR", "Source", "Tent", "get"]
