"""A run's log and progress: every line printed and appended to ``<output>/log.txt`` (`Log`), and a unit's
progress (`Progress`): a tqdm bar on a terminal, elsewhere (CI, nohup, a log file) a line at least every
`LINE_EVERY_S` seconds; the run's progress over its units (`Units`): one line per finished domain with its
accuracy, the running one, img/s and the units done of all."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from pcsr_jax import distributed

LINE_EVERY_S = 60.0  # without a terminal: a progress line at least this often (a CCC walk is one long unit)
LOG_FILE = "log.txt"


class Log:
  """``log(line)``: ``emit(line)`` (print by default) and the line appended to ``<output>/log.txt`` with the time
(`stamped`), by process 0.

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
      flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | (os.O_TRUNC if self._mode == "w" else 0)
      with os.fdopen(os.open(self.path, flags, 0o644), "a") as f:  # never through a link out of the folder
        f.write(stamped(" ".join(map(str, args))) + "\n")
    except OSError:  # the run's own checks report an output folder it cannot write (or a link there)
      return
    self._mode = "a"


def stamped(text: str) -> str:
  """``text`` after the local date and time (``2025-01-31 14:02:07``): a line of log.txt. A text of several lines
  (a table) starts on the line after its time, so that its columns stay aligned."""
  now = time.strftime("%Y-%m-%d %H:%M:%S")
  return f"{now}\n{text}" if "\n" in text.rstrip("\n") else f"{now} {text}"


def header(cfg: Any, argv: Sequence[str]) -> str:
  """A run's first line in its log: the command as typed, and what it runs (methods, seeds, domains, output)."""
  cmd = " ".join(["python"] + [os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]] + list(argv[1:])) \
      if argv and argv[0] else "(from Python)"
  return (f"run into {cfg.output}{' (resumed)' if cfg.resume else ''}: {cmd}; methods {', '.join(cfg.methods)}; "
          f"seed{'s' if len(cfg.seeds) > 1 else ''} {', '.join(map(str, cfg.seeds))}; setting {cfg.setting}")


def for_run(output: str, resume: bool, log: Callable) -> Log:
  """``log`` with the run's log file: itself if it is already a `Log` of ``output`` (the built-in benchmark's
  command logs its header through the same one)."""
  if isinstance(log, Log) and log.path == os.path.join(output, LOG_FILE):
    return log
  return Log(output, resume, log)


class Progress:
  """One unit's progress: a tqdm bar on a terminal, else a line every `LINE_EVERY_S` seconds."""

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

  def close(self) -> None:
    self.bar.close()


class Units:
  """The run's progress over its units: a line when a unit starts (several at once); one line per finished domain
  (`domain`, and `finish` for a unit's last) with its accuracy, the running accuracy of its method and seed,
  img/s, and the units done of all with the time left (`status`, `time_left`: weighted by each unit's expected
  cost); a line per method and seed once all of its units are done."""

  def __init__(self, plan: Sequence[Any], done: set, log: Callable, say_starts: bool,
               passes: Optional[dict] = None):
    import threading

    self.plan, self.log, self.say_starts = list(plan), log, say_starts
    self.passes = dict(passes or {})  # method -> its declared passes per image (`units.declared_passes`)
    self.done = set(done)
    self.t0 = time.monotonic()
    self.first_start: Optional[float] = None  # when the first unit started: the executors' start-up comes before
    self.finished: list = []  # the units finished here (their wall time is in this run's)
    self.timed: dict[str, list] = {}  # method -> [images, seconds of stepping] of its units finished here
    self.rates: dict[str, list] = {}  # method -> the seconds per image of each of its units finished here
    # method/seed -> [seen, correct, seconds, units] of its units finished here
    self.totals: dict[str, list] = {}
    self._lock = threading.Lock()

  def start(self, unit: Any, where: str = "") -> None:
    """A unit starts on ``where`` (a Ray actor), or in this thread (a device group's)."""
    with self._lock:
      self.first_start = time.monotonic() if self.first_start is None else self.first_start
    if self.say_starts:
      self.log(f"{where or threading_name()}: {unit.key} started ({plural(unit.images, 'image')})")

  def running(self, unit: Any, up: Any) -> tuple[int, int]:
    """``(seen, correct)`` of the unit's method and seed: its finished units and this one so far."""
    from pcsr_jax.progress import stem

    with self._lock:
      seen, correct = self.totals.get(stem(unit.key), [0, 0])[:2]
    return seen + up.seen, correct + up.correct

  def time_left(self, now: Optional[float] = None) -> Optional[float]:
    """Seconds until every unit is done (never negative), or None while it cannot be told: the wall time since
    the first unit started (the executors' start-up, once, left out) times the expected cost of the units left
    over that of the units finished here. A unit's expected cost is its images times its method's seconds per
    image, as timed here over its finished units, or for a method not timed yet its declared passes per image
    (`units.declared_passes`) at the seconds per pass of the methods timed: a MEMO unit (65F+64B) weighs some 190
    times a Source one (1F) until one of them has run. That rate is a timed method's fastest unit's, once two of
    its units have finished: a first unit's seconds hold its step's compilation, which on a short unit of a cheap
    method can be most of them, and 190 times that was hours on a table of minutes. Until then, with a method
    left that is not timed, the time left is not told."""
    with self._lock:
      return self._time_left(now)

  def _time_left(self, now: Optional[float]) -> Optional[float]:
    timed = {m: s / i for m, (i, s) in self.timed.items() if i and s > 0}
    if not self.finished or not timed or self.first_start is None:
      return None
    left_units = [u for u in self.plan if u.key not in self.done]
    per_pass = 0.0
    if any(u.method not in timed for u in left_units):
      steady = [min(r) / self._passes(m) for m, r in self.rates.items() if len(r) >= 2]
      if not steady:
        return None
      per_pass = sum(steady) / len(steady)
    cost = lambda u: u.images * timed.get(u.method, self._passes(u.method) * per_pass)
    done = sum(cost(u) for u in self.finished)
    left = sum(cost(u) for u in left_units)
    elapsed = max(0.0, (now if now is not None else time.monotonic()) - self.first_start)
    return elapsed * left / done if done > 0 else None

  def _passes(self, method: str) -> float:
    return self.passes.get(method, 1.0)

  def status(self) -> str:
    """``units N of M done, about T left``: the one place that says how far the run is and how long it has to go
    (`time_left`). Call holding ``self._lock``."""
    left = self._time_left(None) if len(self.done) < len(self.plan) else None
    return f"units {len(self.done)} of {len(self.plan)} done" + (f", about {_duration(left)} left" if left else "")

  def domain(self, unit: Any, name: str, records: Sequence[dict], up: Any) -> None:
    """A domain of a unit that goes on over more domains (a continual stream) closed: its line."""
    seen, correct = self.running(unit, up)
    with self._lock:
      status = self.status()
    self.log(_domain_line(unit.key, name, records, seen, correct, up.images_per_s, status))

  def finish(self, unit: Any, up: Any, name: str, records: Sequence[dict]) -> str:
    """The unit is done (``up``: its `progress.UnitProgress`, or what a Ray actor reports of it); ``name`` and
    ``records``: its last domain, whose line this logs with the unit counted done. Once every unit of the method
    and seed ran here, a line for the method and seed over all of them. Returns the status (Ray's task names
    show it)."""
    from pcsr_jax.progress import stem

    with self._lock:
      self.done.add(unit.key)
      self.finished.append(unit)
      w = self.timed.setdefault(unit.method, [0, 0.0])
      w[0] += up.seen
      w[1] += up.total_seconds
      if up.seen and up.total_seconds > 0:
        self.rates.setdefault(unit.method, []).append(up.total_seconds / up.seen)
      t = self.totals.setdefault(stem(unit.key), [0, 0, 0.0, 0])
      t[0] += up.seen
      t[1] += up.correct
      t[2] += up.total_seconds
      t[3] += 1
      all_here = t[3] == sum(stem(u.key) == stem(unit.key) for u in self.plan)  # every one of them run here
      status = self.status()
      seen, correct, seconds, _ = t
    if records:
      self.log(_domain_line(unit.key, name, records, seen, correct, up.seen / max(up.total_seconds, 1e-9), status))
    if all_here:
      self.log(f"{stem(unit.key)}: accuracy {100 * correct / max(seen, 1):.2f}% over {plural(seen, 'image')}, "
               f"{seen / max(seconds, 1e-9):.1f} img/s end to end")
    return status


def _domain_line(key: str, name: str, records: Sequence[dict], seen: int, correct: int, images_per_s: float,
                 status: str) -> str:
  """``<method>/seed<s> <domain>: accuracy A% (n images); running R% over N images; X img/s; <status>``."""
  from pcsr_jax.progress import stem

  n = sum(r["num_samples"] for r in records)
  acc = sum(r["accuracy"] * r["num_samples"] for r in records) / max(n, 1)
  running = 100 * correct / max(seen, 1)
  return (f"{stem(key)} {name}: accuracy {100 * acc:.1f}% ({plural(n, 'image')}); running {running:.1f}% over "
          f"{plural(seen, 'image')}; {images_per_s:.1f} img/s; {status}")


def plural(n: int, word: str) -> str:
  """``1 image``, ``1,280 images``."""
  return f"{n:,} {word}{'' if n == 1 else 's'}"


def threading_name() -> str:
  """The executor's name in progress lines: its thread's."""
  import threading

  return threading.current_thread().name


def _duration(seconds: float) -> str:
  return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
      f"{seconds:.0f} s"
