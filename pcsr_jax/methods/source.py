"""Source: the pretrained model, no adaptation."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import optax

from pcsr_jax import losses
from pcsr_jax.methods.base import Method, Prepared


@dataclasses.dataclass(frozen=True)
class Source(Method):
  name: ClassVar[str] = "source"
  cost: ClassVar[str] = "1F"

  def prepare(self, model, params, rng, batch_size):
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def update(self, prep, frozen, state, images, valid):
    logits, _ = self.forward(prep, frozen, state.trainable, images)
    ent = losses.entropy(logits)
    return state.replace(step=state.step + 1), logits, {"entropy": losses.masked_mean(ent, valid)}
