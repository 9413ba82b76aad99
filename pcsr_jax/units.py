"""A run's units of work, the device groups that run them at once, and the queue that hands them out.

A unit is one method and seed adapting from the source model over part of the stream: one domain where the
setting puts the model back to the source between domains (normal, bs1, label_shifts) and the method's reset is
a whole one, else the whole stream (continual, gradual, mix_shifts and CCC's walk; CMF, whose official reset
keeps its filter's variance). A unit's randomness is its own: the stream order comes from its seed
(`streams.build`), its step's keys from its method's state at the source, which a per-domain unit starts from as
the sequential run's reset does. So units give the same records in any order, one after another, several at
once on groups of a host's devices (`device_groups`), or on the actors of a Ray cluster
(`pcsr_jax.ray_units`). A unit saves its own progress (`progress.Resume`), so a unit stopped or lost with its
executor goes out again (`Queue`) and resumes where it was saved.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
from typing import Any, Optional, Sequence

from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method

# Settings whose every segment starts from the source model: a unit per domain there.
SPLIT_SETTINGS = ("normal", "bs1", "label_shifts")


@dataclasses.dataclass(frozen=True)
class Unit:
  """One unit: ``key`` (``<method>/seed<s>`` or ``<method>/seed<s>/<domain>``), the indices of the seed's
  segments it streams, and how many images they hold (for the time left)."""

  key: str
  method: str
  seed: int
  segments: tuple[int, ...]
  images: int


def whole_reset(method: Method) -> bool:
  """Whether the method's reset between domains is the source state itself (every method's but CMF's)."""
  return type(method).extra_after_reset is Method.extra_after_reset


def plan(setting: str, seeds: Sequence[int], methods: dict[str, Method], segments: dict[int, list]) -> list[Unit]:
  """The run's units in the order one process runs them: seed after seed, method after method, domain after
  domain. ``segments``: each seed's stream (`streams.build`)."""
  out = []
  for seed in seeds:
    segs = segments[seed]
    for name, method in methods.items():
      if setting in SPLIT_SETTINGS and whole_reset(method) and all(s.reset for s in segs):
        out += [Unit(f"{name}/seed{seed}/{s.name}", name, seed, (i,), len(s.indices)) for i, s in enumerate(segs)]
      else:
        out.append(Unit(f"{name}/seed{seed}", name, seed, tuple(range(len(segs))), sum(len(s.indices) for s in segs)))
  return out


def device_groups(devices: Sequence[Any], per_unit: Optional[int], units: int) -> list[list[Any]]:
  """The local devices in groups of ``per_unit`` (None: one per device on a GPU or TPU host when there are more
  units than devices, else all of them in one group, each batch split over them), one unit per group at once;
  devices left over from a whole number of groups stay idle."""
  n = len(devices)
  if per_unit is None:
    per_unit = 1 if devices and devices[0].platform in ("gpu", "tpu") and units > n else n
  if not 1 <= per_unit <= n:
    cpu = bool(devices) and devices[0].platform == "cpu"
    raise UserError(f"--devices-per-unit: expected 1 to {n} (the local devices), got {per_unit}" +
                    (f"; on a CPU host, --cpu-devices {per_unit} splits the CPU into {per_unit} devices" if cpu
                     else ""))
  return [list(devices[i:i + per_unit]) for i in range(0, n - per_unit + 1, per_unit)]


# Passes of the backbone a forward (F) and a backward (B, about two forwards' work) stand for, in a method's
# declared ``cost`` ("2F+2B", "65F+64B", "2F + 50 UNet F+B per image"); the first alternative of "a / b".
_PASS = re.compile(r"(\d+)\s*(?:UNet\s+)?(F\+B|F|B)")
_WEIGHT = {"F": 1.0, "B": 2.0, "F+B": 3.0}


def declared_passes(method: Method) -> float:
  """The forward-pass equivalents per batch that ``method.cost`` declares (its bracketed, sometimes-taken passes
  left out): what a unit of it is expected to cost per image before one of its units has been timed."""
  main = re.sub(r"\([^)]*\)", "", type(method).cost).split("/")[0]
  return sum(int(n) * _WEIGHT[kind] for n, kind in _PASS.findall(main)) or 1.0


class Queue:
  """Which unit each executor (a device group of this process, or a Ray actor) runs next: the units in plan
  order, each handed out once, those already done skipped; a unit given back unfinished (its executor stopped
  or died) goes out again, in its place in that order."""

  def __init__(self, units: Sequence[Unit], done: set):
    self.units, self.done = list(units), set(done)
    self._lock = threading.Lock()
    self._taken: set[str] = set()

  def next(self, prefer: Optional[tuple[str, int]] = None) -> Optional[Unit]:
    """The next unit; with ``prefer`` (method, seed), the first of that method and seed if any is left (an
    executor that has compiled its step runs the units it can reuse it for)."""
    with self._lock:
      left = [u for u in self.units if u.key not in self._taken and u.key not in self.done]
      if not left:
        return None
      unit = next((u for u in left if (u.method, u.seed) == prefer), left[0])
      self._taken.add(unit.key)
      return unit

  def finish(self, unit: Unit, done: bool) -> None:
    """The executor is done with ``unit``: finished (``done``), or given back to go out again."""
    with self._lock:
      self._taken.discard(unit.key)
      if done:
        self.done.add(unit.key)

  def left(self) -> int:
    with self._lock:
      return sum(u.key not in self.done for u in self.units)


class Stop:
  """SIGINT/SIGTERM set ``requested`` and say so at once (in the main thread); every executor lets its step in
  flight finish, saves its unit's progress at that last finished batch and returns. A second signal quits at
  once (`KeyboardInterrupt`), the progress as last saved."""

  requested = False

  def __init__(self, log=print):
    self.log = log

  def _on(self, signum: int, frame: Any) -> None:
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    self.log(f"{signal.Signals(signum).name}: stopping; each unit's progress is saved at its last finished batch "
             f"once its step in flight is done (again to quit at once, without saving)")

  def __enter__(self):
    self._old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    self.install()
    return self

  def install(self) -> None:
    """Puts the handlers (back) in place: ``ray.init`` sets a SIGTERM handler of its own."""
    for s in (signal.SIGINT, signal.SIGTERM):
      signal.signal(s, self._on)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def execute(executors: Sequence[Any], stop: Any) -> bool:
  """Runs each executor (a device group's loop: `harness._executor`) in a thread of its own, one alone in this
  thread; False when any was stopped. An error in one asks the others to stop (their progress saved) and is
  raised once they have."""
  if len(executors) == 1:
    return executors[0]()
  outcome: list = [None] * len(executors)
  errors: list = []

  def go(i: int) -> None:
    try:
      outcome[i] = executors[i]()
    except BaseException as e:  # noqa: BLE001 -- re-raised below, in the calling thread
      errors.append(e)
      stop.requested = True

  threads = [threading.Thread(target=go, args=(i,), name=f"group{i}", daemon=True) for i in range(len(executors))]
  for t in threads:
    t.start()
  for t in threads:
    while t.is_alive():
      t.join(0.5)  # short waits: the main thread keeps taking SIGINT/SIGTERM
  if errors:
    raise errors[0]
  return all(outcome)
