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
      with open(self.path, self._mode) as f:
        f.write(stamped(" ".join(map(str, args))) + "\n")
    except OSError:  # the run's own checks report an output folder it cannot write
      return
    self._mode = "a"


def stamped(text: str) -> str:
  """``text`` after the local date and time (``2025-01-31 14:02:07``): a line of log.txt. A text of several lines
  (a table) starts on the line after its time, so that its columns stay aligned."""
  now = time.strftime("%Y-%m-%d %H:%M:%S")
  return f"{now}\n{text}" if "\n" in text.rstrip("\n") else f"{now} {text}"


def header(cfg: Any, worker: Optional[str], argv: Sequence[str]) -> str:
  """A run's first line in its log: the command as typed, and what it runs (methods, seeds, domains, output);
  for a worker of a shared table (``worker``), which worker this is."""
  who = f"worker {worker} of the table in {cfg.output}" if worker else f"run into {cfg.output}"
  cmd = " ".join(["python"] + [os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]] + list(argv[1:])) \
      if argv and argv[0] else "(from Python)"
  return (f"{who}{' (resumed)' if cfg.resume else ''}: {cmd}; methods {', '.join(cfg.methods)}; "
          f"seed{'s' if len(cfg.seeds) > 1 else ''} {', '.join(map(str, cfg.seeds))}; setting {cfg.setting}")


def for_run(output: str, resume: bool, log: Callable, worker: Optional[str] = None) -> Log:
  """``log`` with the run's log file: itself if it is already a `Log` of ``output`` (the built-in benchmark's
  command logs its header through the same one). A worker of a shared table (``worker``) logs to
  ``log-<worker>.txt``, beside the others'."""
  name = LOG_FILE if worker is None else f"log-{worker.replace(':', '_')}.txt"
  if isinstance(log, Log) and log.path == os.path.join(output, name):
    return log
  return Log(output, resume, log, name)


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
  """The run's progress over its units: a line when a unit starts (several at once, or a shared table); one line
  per finished domain (`domain`, and `finish` for a unit's last) with its accuracy, the running accuracy of its
  method and seed, img/s, and the units done of all with an estimate of the time left (`status`); a line per
  method and seed once all of its units are done."""

  def __init__(self, plan: Sequence[Any], done: set, log: Callable, say_starts: bool, who: str = ""):
    import threading

    self.plan, self.log, self.say_starts, self.who = list(plan), log, say_starts, who
    self.done = set(done)
    self.t0 = time.monotonic()
    self.images = 0  # streamed by this process
    # method/seed -> [seen, correct, seconds, units] of its units finished by this process
    self.totals: dict[str, list] = {}
    self._lock = threading.Lock()

  def start(self, unit: Any) -> None:
    if self.say_starts:
      self.log(f"{self.who}{threading_name()}: {unit.key} started ({plural(unit.images, 'image')})")

  def running(self, unit: Any, up: Any) -> tuple[int, int]:
    """``(seen, correct)`` of the unit's method and seed: its finished units and this one so far."""
    from pcsr_jax.progress import stem

    with self._lock:
      seen, correct = self.totals.get(stem(unit.key), [0, 0])[:2]
    return seen + up.seen, correct + up.correct

  def status(self) -> str:
    """``units N of M done, about T left``: the one place that says how far the run is and how long it has to go
    (the time left from the images this process streamed so far and those of the units left). Call holding
    ``self._lock``."""
    left = sum(u.images for u in self.plan if u.key not in self.done)
    rate = self.images / max(time.monotonic() - self.t0, 1e-9)
    eta = f", about {_duration(left / rate)} left" if left and self.images else ""
    return f"units {len(self.done)} of {len(self.plan)} done{eta}"

  def domain(self, unit: Any, name: str, records: Sequence[dict], up: Any) -> None:
    """A domain of a unit that goes on over more domains (a continual stream) closed: its line."""
    seen, correct = self.running(unit, up)
    with self._lock:
      status = self.status()
    self.log(_domain_line(unit.key, name, records, seen, correct, up.images_per_s, status))

  def finish(self, unit: Any, up: Any, name: str, records: Sequence[dict]) -> None:
    """The unit is done; ``name`` and ``records``: its last domain, whose line this logs with the unit counted
    done. Once every unit of the method and seed ran here, a line for the method and seed over all of them."""
    from pcsr_jax.progress import stem

    with self._lock:
      self.done.add(unit.key)
      self.images += up.seen
      t = self.totals.setdefault(stem(unit.key), [0, 0, 0.0, 0])
      t[0] += up.seen
      t[1] += up.correct
      t[2] += up.total_seconds
      t[3] += 1
      all_here = t[3] == sum(stem(u.key) == stem(unit.key) for u in self.plan)  # every one of them run here
      status = self.status()
      seen, correct, seconds, _ = t
    if records:
      self.log(_domain_line(unit.key, name, records, seen, correct, up.images_per_s, status))
    if all_here:
      self.log(f"{stem(unit.key)}: accuracy {100 * correct / max(seen, 1):.2f}% over {plural(seen, 'image')}, "
               f"{seen / max(seconds, 1e-9):.1f} img/s end to end")


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
