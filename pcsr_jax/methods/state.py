"""What a method carries along a stream (`AdaptState`) and what its `Method.prepare` returns (`Prepared`): the
interface's two data types, beside which the method's helpers (`rows`, `optimizers`) and `base.Method` sit."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax
import flax.linen as nn
import jax
import optax

Array = jax.Array
Params = Any
Path = tuple[str, ...]


@flax.struct.dataclass
class AdaptState:
  """Everything that changes along a stream (a pytree; donated to every step).

  ``extra`` is the method's own state (`Method.init_extra`): any pytree, which
  the engine carries, donates and places, and the harness checkpoints and
  resumes with the rest (SAR's `Recovery`; ``None`` for methods without one).
  ``resets`` counts in-step recoveries, reported per domain in the records.
  """

  trainable: Params
  opt_state: Any
  step: Array
  rng: Array
  resets: Array
  extra: Any = None


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `Method.prepare` returns."""

  model: nn.Module
  params: Params
  is_trainable: Callable[[Path], bool]
  tx: optax.GradientTransformation
  parts: Mapping[str, optax.GradientTransformation] = dataclasses.field(default_factory=dict)  # of a `parallel` tx
  # Read-only arrays the step needs besides the params: the method's source statistics (EATA's Fisher, CFA's
  # moments, FOA's feature mean/std). The engine places them on the device and passes them to the compiled
  # step as an argument (inside `Method.update` they are traced values, never constants baked into the program).
  consts: Any = None
  # The engine's device mesh (a 1-D ``'data'`` mesh), set while it traces the step; None outside the engine.
  # A method that gathers a dynamic subset of the batch (`kept_row_chunks`) shards the subset over it.
  mesh: Optional[jax.sharding.Mesh] = None
  # Rows per pass of `Method.forward` (the engine's ``row_chunk``): None runs a batch as one pass.
  row_chunk: Optional[int] = None
  # The platform the step is built for ("cpu", "gpu", "tpu": `pcsr_jax.platforms`), set by the engine from its
  # mesh or its ``platform`` argument; every platform switch of a method reads it, never the default backend.
  platform: str = "cpu"
