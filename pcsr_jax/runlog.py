"""A run's log and progress: every line printed and appended to ``<output>/log.txt`` (`Log`), and a unit's
progress (`Progress`): a tqdm bar on a terminal, elsewhere (CI, nohup, a log file) a line at least every
`LINE_EVERY_S` seconds, and on both a line per domain with its accuracy and the running one."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

from pcsr_jax import distributed

LINE_EVERY_S = 60.0  # without a terminal: a progress line at least this often (a CCC walk is one long unit)
LOG_FILE = "log.txt"


class Log:
  """``log(line)``: ``emit(line)`` (print by default) and the line appended to ``<output>/log.txt``, by process 0.

  The file starts afresh with a run that starts afresh (``append=False``) and is appended to by a resumed one; it
  is opened at the first line, so that an output folder that cannot be made yet is reported by the run's checks,
  not here."""

  def __init__(self, output: str, append: bool, emit: Callable = print):
    self.path = os.path.join(output, LOG_FILE)
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

  def segment(self, name: str, records: Sequence[dict], seen: int, correct: int, images_per_s: float) -> None:
    """A domain closed: its accuracy (over its ``records``) and the unit's running accuracy."""
    if not (self.show and seen):
      return
    n = sum(r["num_samples"] for r in records)
    acc = sum(r["accuracy"] * r["num_samples"] for r in records) / max(n, 1)
    self.log(f"{self.key} {name}: accuracy {100 * acc:.1f}% on {name} ({n:,} images); running accuracy "
             f"{100 * correct / seen:.1f}% over {seen:,} images, {images_per_s:.1f} img/s")
    self.last = time.monotonic()

  def close(self) -> None:
    self.bar.close()
