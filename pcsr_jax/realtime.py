"""The realistic online protocol (`--realtime RATE`): a stream that reveals its batches at a constant speed, so that
a method slower than the stream adapts on fewer batches. Pure Python, no jax: the flags are checked before jax
loads, and the schedule is a function tests can read.

Alfarra et al., "Evaluation of Test-Time Adaptation Under Computational Time Constraints" (ICML 2024); their code
is MotasemAlfarra/Online_Test_Time_Adaptation (commit 8e21fad). Where the paper leaves a choice open, the code
decides, and so do we:

* **What the stream's speed is.** ``--realtime source``: one batch per forward of the source model on this device
  (the code's ``eta=1``, `utils/argparse.py:21`: "eta=1 means stream is as fast as regular forward pass", the
  base time being the wrapped network's forward, `utils/online_eval.py:29`). ``--realtime N``: N images per
  second, one batch per ``batch_size / N`` seconds (the code's ``eta`` other than 1, as a rate).
* **The relative cost.** ``C = max(1, ceil(t_adapt / t_reveal))``, as `utils/online_eval.py:30-31` sets
  ``delay = max(0, ceil(ratio * eta) - 1)`` batches to skip after an adapted one (``C = delay + 1``). The code
  times every adapted batch on the fly, first call included (lines 11-16); we time the step once per method,
  after compilation, the median over ``--cost-batches`` steps (`cost.probe`; its
  `utils/compute_average_complexity.py:24-33` also takes a median over runs), and keep that C for the whole run:
  a run is then a function of its C's, which results.json records and ``--realtime-cost`` can fix.
* **What a skipped batch gets.** A forward of the method's latest adapted parameters, no adaptation: the code
  predicts it with ``model.model(images)`` (`utils/online_eval.py:35-36`), the very network the method updates
  in place. Where a method's own prediction is not that network's forward, a skipped batch still gets the
  network's (`engine.Adapter.predict`: `Method.forward` of the adapted params), as ``model.model`` is CoTTA's
  student, not its teacher (`tta_methods/cotta.py:23`), and DDA's classifier without the diffusion ensemble
  (`tta_methods/dda.py:11`); so here T3A's skipped batches get the source head, not its prototypes. (Its
  ``--single_model`` variant, random predictions for skipped batches, lines 33-34, is not the
  paper's main protocol and is not offered.)
* **Skipped or queued.** Skipped: a batch that arrives while the method adapts is predicted and never adapted on
  (`utils/online_eval.py:32-37` only counts ``delay`` down); nothing is queued, and the stream order is kept.
* **Where the schedule restarts.** At every domain: ``delay = 0`` at the start of each corruption's evaluation
  (`utils/online_eval.py:22`, called per corruption by `main.py:38`), so a domain's batch 0 is adapted on.
  Here a unit's segment is a domain (the continual and gradual settings' segments too); the batch index is the
  segment's (`progress.UnitProgress.batch`), saved with the progress, so ``--resume`` keeps the schedule.
"""

from __future__ import annotations

import math
from typing import Optional, Union

from pcsr_jax.errors import UserError

SOURCE = "source"


def parse_rate(text: Optional[str]) -> Union[None, str, float]:
  """``--realtime``: ``source`` or a positive number of images per second (None: not given)."""
  if text is None:
    return None
  if isinstance(text, (int, float)) and not isinstance(text, bool):
    rate = float(text)
  elif str(text).strip().lower() == SOURCE:
    return SOURCE
  else:
    try:
      rate = float(str(text).strip())
    except ValueError:
      raise UserError(f"--realtime: expected 'source' or a positive number of images per second, got '{text}'") \
          from None
  if not (math.isfinite(rate) and rate > 0):
    raise UserError(f"--realtime: expected 'source' or a positive number of images per second, got '{text}'")
  return rate


def parse_costs(text: Optional[str]) -> dict[str, int]:
  """``--realtime-cost METHOD=C,...``: each method's relative cost, a positive integer, each method once."""
  if text is None:
    return {}
  if isinstance(text, dict):
    items = list(text.items())
  else:
    items = []
    for part in str(text).split(","):
      name, eq, value = part.partition("=")
      if not eq or not name.strip():
        raise UserError(f"--realtime-cost: expected METHOD=C,... (e.g. tent=2,sar=3), got '{text}'")
      items.append((name.strip(), value.strip()))
  costs: dict[str, int] = {}
  for name, value in items:
    try:
      c = int(value)
    except (TypeError, ValueError):
      c = None
    if c is None or isinstance(value, bool) or c < 1 or (isinstance(value, float) and not value.is_integer()):
      raise UserError(f"--realtime-cost: {name}'s cost must be a positive integer (batches per adapted batch), "
                      f"got '{value}'")
    if name in costs:
      raise UserError(f"--realtime-cost: {name} given twice; give each once")
    costs[name] = c
  return costs


def relative_cost(t_adapt: float, t_reveal: float) -> int:
  """``C = max(1, ceil(t_adapt / t_reveal))``: the batches the stream reveals while the method adapts on one
  (`utils/online_eval.py:30-31`: ``delay = max(0, ceil(ratio * eta) - 1)``, ``C = delay + 1``)."""
  if not (t_adapt > 0 and t_reveal > 0):
    raise ValueError(f"times must be positive, got t_adapt={t_adapt}, t_reveal={t_reveal}")
  return max(1, math.ceil(t_adapt / t_reveal))


def adapts(batch: int, c: int) -> bool:
  """Whether the method adapts on a domain's batch ``batch`` (from 0) at relative cost ``c``: batches 0, c, 2c,
  ...; the others are predicted by a forward of the latest adapted parameters (`utils/online_eval.py:27-37`)."""
  return batch % c == 0


def adapted_batches(n_batches: int, c: int) -> int:
  """How many of a domain's ``n_batches`` batches the method adapts on at cost ``c``."""
  return -(-n_batches // c)


def reveal_seconds(rate: Union[str, float], batch_size: int, source_step_s: Optional[float]) -> float:
  """The seconds between two revealed batches: a Source forward's (``source``) or ``batch_size / rate``."""
  if rate == SOURCE:
    if source_step_s is None:
      raise ValueError("--realtime source needs Source's step time")
    return source_step_s
  return batch_size / float(rate)


def describe(rate: Union[str, float]) -> str:
  """The stream's speed in words (the table's caption, the log)."""
  return "one batch per Source forward on this device" if rate == SOURCE else f"{float(rate):g} images/s"
