"""A run's units of work, the device groups that run them at once, and the claims that share them out.

A unit is one method and seed adapting from the source model over part of the stream: one domain where the
setting puts the model back to the source between domains (normal, bs1, label_shifts) and the method's reset is
a whole one, else the whole stream (continual, gradual, mix_shifts and CCC's walk; CMF, whose official reset
keeps its filter's variance). A unit's randomness is its own: the stream order comes from its seed
(`streams.build`), its step's keys from its method's state at the source, which a per-domain unit starts from as
the sequential run's reset does. So units give the same records in any order, one after another, several at
once on groups of a host's devices (`device_groups`), or claimed by several workers (processes, SLURM tasks,
hosts) that share the output folder (`Claims`).

Claims live on the shared filesystem (``<output>/resume/claims``): a worker claims a unit by creating its file
exclusively (``O_CREAT | O_EXCL``), keeps it fresh while it runs (its mtime, every quarter of the timeout), and a
claim whose worker died (on this host: its process is gone; elsewhere: no heartbeat for ``timeout`` seconds) is
taken over by renaming it away first (atomic: of two workers that race for it, one wins) and claimed anew; the
unit then resumes from its saved progress. No server: only the filesystem's atomic create, rename and link.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time
from typing import Any, Optional, Sequence

from pcsr_jax import progress
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method

# Settings whose every segment starts from the source model: a unit per domain there.
SPLIT_SETTINGS = ("normal", "bs1", "label_shifts")
HEARTBEATS_PER_TIMEOUT = 4


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


def worker_id() -> str:
  """This worker's name in claims and logs: host and process."""
  return f"{socket.gethostname()}:{os.getpid()}"


class Claims:
  """Which unit each executor (a device group of this process) runs next.

  Alone (``shared`` False), the units go out in plan order, each once, those already done skipped. Shared with
  other workers (``--join``), a unit is also claimed on disk (``<output>/resume/claims/<unit>``) and skipped
  while another worker holds it or has finished it; a heartbeat thread keeps this worker's claims and its
  registration (``resume/workers/<worker>``) fresh."""

  def __init__(self, units: Sequence[Unit], resume: progress.Resume, done: set, shared: bool = False,
               timeout_s: float = 300.0):
    self.units, self.resume, self.done, self.shared = list(units), resume, set(done), shared
    self.timeout_s = timeout_s
    self.me = worker_id()
    self.dir = os.path.join(resume.dir, "claims")
    self._lock = threading.Lock()
    self._taken: set[str] = set()
    self._held: dict[str, str] = {}  # unit key -> its claim file
    self._stop = threading.Event()
    self._beat: Optional[threading.Thread] = None
    if shared:
      os.makedirs(self.dir, exist_ok=True)
      os.makedirs(os.path.join(resume.dir, "workers"), exist_ok=True)
      self._touch(self._worker_file(), create=True)
      self._beat = threading.Thread(target=self._heartbeat, daemon=True)
      self._beat.start()

  def _worker_file(self) -> str:
    return os.path.join(self.resume.dir, "workers", self.me.replace(":", "_"))

  def next(self) -> Optional[Unit]:
    """The next unit for an executor of this process, claimed; None when none is left to claim."""
    with self._lock:
      for u in self.units:
        if u.key in self._taken or u.key in self.done:
          continue
        if self.shared and not self._claim(u.key):
          continue
        self._taken.add(u.key)
        return u
    return None

  def finish(self, unit: Unit, done: bool) -> None:
    """The executor is done with ``unit`` (``done``: finished; else stopped, its progress saved): its claim goes."""
    with self._lock:
      if done:
        self.done.add(unit.key)
      path = self._held.pop(unit.key, None)
    if path is not None:
      try:
        os.remove(path)
      except FileNotFoundError:
        pass

  def _finished_elsewhere(self, key: str) -> bool:
    try:
      rec = self.resume.load_unit(key)
    except UserError:
      return False  # a damaged record: the claim decides, and its runner reports it
    if rec is not None and rec.done:
      self.done.add(key)
      return True
    return False

  def _claim(self, key: str) -> bool:
    path = self.resume.claim_path(key)
    body = json.dumps(dict(worker=self.me, host=socket.gethostname(), pid=os.getpid(), since=time.time()))
    for _ in range(2):  # a fresh claim, or a dead worker's taken over and claimed afresh
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        if not self._stale(path) or not self._take_over(path):
          return False
        continue
      with os.fdopen(fd, "w") as f:
        f.write(body)
      if self._finished_elsewhere(key):  # finished by another worker, before or while we claimed it
        os.remove(path)
        return False
      self._held[key] = path
      return True
    return False

  def _stale(self, path: str) -> bool:
    """A claim whose worker is gone: on this host, its process; anywhere, its heartbeat older than the timeout."""
    try:
      with open(path) as f:
        owner = json.load(f)
      age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
      return True
    except (OSError, ValueError):
      return False  # being written: not stale
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
      if owner["pid"] == os.getpid():
        return False
      try:
        os.kill(owner["pid"], 0)
      except ProcessLookupError:
        return True
      except PermissionError:
        pass
    return age > self.timeout_s

  def _take_over(self, path: str) -> bool:
    """Moves a stale claim away; only one of the workers that race for it wins."""
    try:
      os.rename(path, f"{path}.stale-{self.me.replace(':', '_')}-{time.time_ns()}")
    except FileNotFoundError:
      return True  # gone already: claim it afresh
    for f in os.listdir(self.dir):
      if f.startswith(os.path.basename(path) + ".stale-"):
        try:
          os.remove(os.path.join(self.dir, f))
        except FileNotFoundError:
          pass
    return True

  @staticmethod
  def _touch(path: str, create: bool = False) -> None:
    try:
      if create:
        with open(path, "a"):
          pass
      os.utime(path)
    except FileNotFoundError:
      pass

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.timeout_s / HEARTBEATS_PER_TIMEOUT):
      with self._lock:
        held = list(self._held.values())
      for path in held:
        self._touch(path)
      self._touch(self._worker_file())

  def workers_seen(self) -> int:
    """How many workers have registered in the shared output folder (this one included)."""
    try:
      return len(os.listdir(os.path.join(self.resume.dir, "workers")))
    except FileNotFoundError:
      return 1

  def wait_for_workers(self, expected: int, log) -> None:
    """Waits up to the claim timeout for ``expected`` workers to register; fewer is a one-line error: an output
    folder each host sees alone would have every worker run the whole table."""
    deadline = time.monotonic() + self.timeout_s
    while self.workers_seen() < expected:
      if time.monotonic() > deadline:
        raise UserError(f"--expect-workers {expected}: {self.workers_seen()} worker(s) registered in "
                        f"{os.path.dirname(self._worker_file())} within {self.timeout_s:g} s; is --output a folder "
                        f"every worker shares?")
      time.sleep(min(1.0, self.timeout_s / 10))
    log(f"{self.me}: {self.workers_seen()} workers share {os.path.dirname(self.resume.dir)}")

  def close(self) -> None:
    self._stop.set()
    for unit in [u for u in self.units if u.key in self._held]:
      self.finish(unit, False)


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
    self._old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
    return self

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
