"""A run's log and progress: every line printed and appended to ``<output>/log.txt`` (`Log`), and a unit's
progress (`Progress`): a tqdm bar on a terminal, elsewhere (CI, nohup, a log file) a line at least every
`LINE_EVERY_S` seconds, and on both a line per domain with its accuracy and the running one."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from pcsr_jax import distributed

LINE_EVERY_S = 60.0  # without a terminal: a progress line at least this often (a CCC walk is one long unit)
LOG_FILE = "log.txt"


class Log:
  """``log(line)``: ``emit(line)`` (print by default) and the line appended to ``<output>/log.txt``, by process 0.

  The file starts afresh with a run that starts afresh (``append=False``) and is appended to by a resumed one; it
  is opened at the first line, so that an output folder that cannot be made yet is reported by the run's checks,
  not here."""

  def __init__(self, output: str, append: bool, emit: Callable = print, name: str = LOG_FILE):
    self.path = os.path.join(output, name)
    self.emit, self._mode = emit, "a" if append else "w"

  def __call__(self, *args, **kw) -> None:
    self.emit(*args, **kw)
    if not distributed.is_main():
      return
    try:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      with open(self.path, self._mode) as f:
        f.write(" ".join(map(str, args)) + "\n")
    except OSError:  # the run's own checks report an output folder it cannot write
      return
    self._mode = "a"


def for_run(output: str, resume: bool, log: Callable) -> Log:
  """``log`` with the run's log file: itself if it is already a `Log` of ``output`` (the built-in benchmark's
  command logs its header through the same one)."""
  if isinstance(log, Log) and log.path == os.path.join(output, LOG_FILE):
    return log
  return Log(output, resume, log)


class Progress:
  """One unit's progress: a tqdm bar on a terminal, else a line every `LINE_EVERY_S` seconds; a line per domain
  on both (`segment`)."""

  def __init__(self, show: bool, key: str, total: int, initial: int, log: Callable):
    from tqdm import tqdm

    self.key, self.log, self.total = key, log, total
    show = show and distributed.is_main()
    self.show = show
    self.tty = show and sys.stderr.isatty()
    self.lines = show and not self.tty
    self.done = initial
    self.last = time.monotonic()
    self.bar = tqdm(total=total, initial=initial, desc=key, disable=not self.tty, leave=False, file=sys.stderr)

  def update(self, seen: int, correct: int, seconds: float, domain: str) -> None:
    """After a batch: ``seen``/``correct`` over the unit so far, in ``seconds`` of stepping."""
    self.done += 1
    self.bar.update(1)
    rate = f"{seen / seconds:.1f}" if seconds > 0 else "-"
    if self.tty and seen:
      self.bar.set_postfix(acc=f"{100 * correct / seen:.1f}", img_s=rate)
    now = time.monotonic()
    if self.lines and now - self.last >= LINE_EVERY_S:
      self.last = now
      acc = f"running accuracy {100 * correct / seen:.1f}% over {seen:,} images" if seen else "no image scored yet"
      self.log(f"{self.key}: batch {self.done:,} of {self.total:,} ({domain}), {acc}, {rate} img/s")

  def segment(self, stem: str, name: str, records: Sequence[dict], seen: int, correct: int,
              images_per_s: float) -> None:
    """A domain of ``stem`` (its method and seed) closed: its accuracy (over its ``records``) and the running
    accuracy of the method and seed over the domains finished so far (``seen``, ``correct``)."""
    if not (self.show and seen):
      return
    n = sum(r["num_samples"] for r in records)
    acc = sum(r["accuracy"] * r["num_samples"] for r in records) / max(n, 1)
    self.log(f"{stem} {name}: accuracy {100 * acc:.1f}% on {name} ({n:,} images); running accuracy "
             f"{100 * correct / seen:.1f}% over {seen:,} images, {images_per_s:.1f} img/s")
    self.last = time.monotonic()

  def close(self) -> None:
    self.bar.close()


class Units:
  """The run's progress over its units: a line when a unit starts (several at once) and when it ends, with the
  units done of all and the time left (`time_left`); each method and seed's running accuracy over its finished
  units, and a line once all of them are done."""

  def __init__(self, plan: Sequence[Any], done: set, log: Callable, say_starts: bool,
               passes: Optional[dict] = None, who: str = ""):
    import threading

    self.plan, self.log, self.say_starts, self.who = list(plan), log, say_starts, who
    self.passes = dict(passes or {})  # method -> its declared passes per image (`units.declared_passes`)
    self.done = set(done)
    self.t0 = time.monotonic()
    self.images = 0  # streamed here
    self.finished: list = []  # the units finished here (their wall time is in this run's)
    self.timed: dict[str, list] = {}  # method -> [images, seconds of stepping] of its units finished here
    # method/seed -> [seen, correct, seconds, units] of its units finished here
    self.totals: dict[str, list] = {}
    self._lock = threading.Lock()

  def start(self, unit: Any, where: str = "") -> None:
    if self.say_starts:
      self.log(f"{self.who}{where or threading_name()}: {unit.key} started ({unit.images:,} images)")

  def running(self, unit: Any, up: Any) -> tuple[int, int]:
    """``(seen, correct)`` of the unit's method and seed: its finished units and this one so far."""
    from pcsr_jax.progress import stem

    with self._lock:
      seen, correct = self.totals.get(stem(unit.key), [0, 0])[:2]
    return seen + up.seen, correct + up.correct

  def time_left(self, now: Optional[float] = None) -> Optional[float]:
    """Seconds until every unit is done, or None before a unit has finished here: the wall time so far times the
    expected cost of the units left over that of the units finished here. A unit's expected cost is its images
    times its method's seconds per image, as timed here over its finished units, or for a method not timed yet
    its declared passes per image (`units.declared_passes`) at the seconds per pass of the methods timed: a MEMO
    unit (65F+64B) weighs some 60 times a Source one (1F) until one of them has run."""
    with self._lock:
      timed = {m: s / i for m, (i, s) in self.timed.items() if i and s > 0}
      if not self.finished or not timed:
        return None
      per_pass = sum(self.timed[m][1] for m in timed) / sum(self.timed[m][0] * self._passes(m) for m in timed)
      cost = lambda u: u.images * timed.get(u.method, self._passes(u.method) * per_pass)
      done = sum(cost(u) for u in self.finished)
      left = sum(cost(u) for u in self.plan if u.key not in self.done)
    elapsed = (now if now is not None else time.monotonic()) - self.t0
    return elapsed * left / done if done > 0 else None

  def _passes(self, method: str) -> float:
    return self.passes.get(method, 1.0)

  def finish(self, unit: Any, up: Any) -> str:
    """Records a unit finished here (``up``: its `progress.UnitProgress`, or what a Ray actor reports of it) and
    logs its line; returns the units-done part of it (the Ray executor's task names show it)."""
    from pcsr_jax.progress import stem

    with self._lock:
      self.done.add(unit.key)
      self.finished.append(unit)
      self.images += up.seen
      w = self.timed.setdefault(unit.method, [0, 0.0])
      w[0] += up.seen
      w[1] += up.total_seconds
      t = self.totals.setdefault(stem(unit.key), [0, 0, 0.0, 0])
      t[0] += up.seen
      t[1] += up.correct
      t[2] += up.total_seconds
      t[3] += 1
      all_here = t[3] == sum(stem(u.key) == stem(unit.key) for u in self.plan)  # every one of them run here
      n_done = len(self.done)
    left = self.time_left() if n_done < len(self.plan) else None
    status = f"units {n_done} of {len(self.plan)} done" + (f", about {_duration(left)} left" if left else "")
    if unit.key != stem(unit.key):
      self.log(f"{unit.key}: accuracy {100 * up.correct / max(up.seen, 1):.2f}% over {up.seen:,} images; {status}")
    if all_here:
      seen, correct, seconds, _ = t
      self.log(f"{stem(unit.key)}: accuracy {100 * correct / max(seen, 1):.2f}% over {seen:,} images, "
               f"{seen / max(seconds, 1e-9):.1f} img/s end to end" +
               (f"; {status}" if unit.key == stem(unit.key) else ""))
    return status


def threading_name() -> str:
  """The executor's name in progress lines: its thread's."""
  import threading

  return threading.current_thread().name


def _duration(seconds: float) -> str:
  return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
      f"{seconds:.0f} s"
