"""One writer per output folder: a run holds ``<output>/.lock`` (an exclusive ``flock``) from before it reads or
discards any progress there until it has written its outputs, and writes its holder (host, pid, start time,
command) and its generation into it. A second run on the same folder, on this host or on another that shares
the folder, is refused in one line naming the holder, instead of running the table again and discarding the
first run's progress under it.

``flock`` locks go with the process: a run that is killed leaves no stale lock behind (the file stays, unlocked,
and the next run takes it). On NFS, Linux maps ``flock`` onto the server's byte-range locks, so hosts sharing
the folder see each other's lock. The lock files are opened without following a link (``O_NOFOLLOW``) and must
be regular files with one name: nothing outside the output folder is written through a link there.

Fencing (`Fence`): a Ray actor writes a unit's progress into the folder for its driver, and may outlive it (Ray
kills a dead driver's actors, but not at once). Each hold of the folder gets the next generation (a counter in
the lock file); the driver's actors carry it, and before each write of progress an actor checks, under a shared
lock of ``<output>/.lock.writers``, that the folder's lock is still held and still of its generation. A new
holder takes ``.lock.writers`` exclusively once, right after its lock and before it reads any progress: a write
that passed its check before has finished by then, and every later check sees the new generation. A stale actor
drops its unit (`Fenced`) and writes nothing more.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from typing import Iterator, Optional

from pcsr_jax.errors import UserError

LOCK_FILE = ".lock"
WRITERS_FILE = ".lock.writers"
DRAIN_S = 60.0  # an earlier run's actor holds .lock.writers for one write: a unit record, milliseconds
TAKE_S = 2.0  # a lock found held is tried again for this long: an actor's liveness probe holds it for microseconds


class Fenced(Exception):
  """A write refused to an actor whose driver no longer holds the output folder (dead, or replaced)."""


def _open(path: str, what: str, output: str) -> int:
  """``path`` (the lock file, or the writers' lock file) opened for reading and writing, created if missing, never
  through a link: a symbolic link there (``O_NOFOLLOW``), anything but a regular file, or a file with other names
  (a hard link) is a one-line `UserError`, since the run truncates and writes the lock file and must write
  nothing outside ``output``."""
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise UserError(f"--output {output}: its {what} {path} is a symbolic link; the run writes its lock there "
                      f"and follows no link out of --output: remove the link") from None
    odd = e.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP)  # a folder, a socket, a device there
    raise UserError(f"--output {output}: cannot open its {what} {path} ({e.strerror})"
                    + ("; it must be a regular file, or absent" if odd else "")) from None
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
    os.close(fd)
    kind = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
    raise UserError(f"--output {output}: its {what} {path} is {kind}; the run writes its lock there: remove "
                    f"it") from None
  return fd


def _read_body(fd: int) -> dict:
  """The lock file's JSON (host, pid, since, command, generation); {} when empty or unreadable."""
  try:
    body = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
  except (OSError, ValueError, UnicodeDecodeError):
    return {}
  return body if isinstance(body, dict) else {}


def _generation(body: dict) -> int:
  """The generation a lock file's body records (0 for none, or garbage there)."""
  g = body.get("generation")
  return g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0


def holder(output: str) -> str:
  """Who holds (or last held) ``output``'s lock, as the refusal names it: ``host:pid since <time>``."""
  try:
    with open(os.path.join(output, LOCK_FILE)) as f:
      who = json.load(f)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(who["since"])))
    return f"{who['host']}:{who['pid']} (since {since}: {who.get('command', '')})".replace(": )", ")")
  except (OSError, ValueError, KeyError, TypeError):
    return "another run (its holder file is unreadable)"


# The folders this process holds, with how many blocks hold each and their generation: a command that holds its
# output around its runs (the built-in benchmark's header goes into log.txt first) and the run inside it share
# the one lock.
_HELD: dict[str, list] = {}


def generation(output: str) -> Optional[int]:
  """The generation of this process's hold on ``output`` (None when it holds none)."""
  held = _HELD.get(os.path.realpath(os.path.join(output, LOCK_FILE)))
  return held[1] if held else None


@contextlib.contextmanager
def hold(output: str, command: str = "") -> Iterator[None]:
  """Holds ``output``'s lock for the block (again inside a block of this process that holds it; `generation`
  tells its generation). A folder another run holds is a `UserError` naming the holder."""
  try:
    os.makedirs(output, exist_ok=True)
  except OSError as e:
    raise UserError(f"--output {output}: cannot make the folder ({e.strerror or type(e).__name__})") from None
  path = os.path.join(output, LOCK_FILE)
  key = os.path.realpath(path)
  if key in _HELD:
    _HELD[key][0] += 1
    try:
      yield
    finally:
      _HELD[key][0] -= 1
    return
  fd = _open(path, "lock file", output)
  try:
    _take(fd, output, path)
    gen = _generation(_read_body(fd)) + 1
    body = json.dumps(dict(host=socket.gethostname(), pid=os.getpid(), since=time.time(), command=command,
                           generation=gen))
    os.ftruncate(fd, 0)
    os.pwrite(fd, body.encode(), 0)
    os.fsync(fd)
    _drain_writers(output)
    _HELD[key] = [1, gen]
    try:
      yield
    finally:
      del _HELD[key]
  finally:
    os.close(fd)  # releases the lock


def _take(fd: int, output: str, path: str) -> None:
  """The exclusive lock on ``fd``, tried for `TAKE_S` before a held folder is refused in one line."""
  if not _lock_within(fd, TAKE_S, output, path):
    raise UserError(f"--output {output}: in use by the run {holder(output)}; wait for it to end, or give another "
                    f"--output")


def _drain_writers(output: str) -> None:
  """Waits for the writes of an earlier holder's actors that passed their check (they hold ``.lock.writers``
  shared while they write): after this, each sees the new generation and is refused."""
  path = os.path.join(output, WRITERS_FILE)
  fd = _open(path, "writers' lock file", output)
  try:
    if not _lock_within(fd, DRAIN_S, output, path):
      raise UserError(f"--output {output}: a Ray actor of an earlier run is still writing there (it holds "
                      f"{WRITERS_FILE} after {DRAIN_S:.0f} s); stop that run's Ray actors, then rerun")
  finally:
    os.close(fd)


def _lock_within(fd: int, seconds: float, output: str, path: str) -> bool:
  """Whether the exclusive ``flock`` on ``fd`` was had within ``seconds`` (the holder is still there if not)."""
  deadline = time.monotonic() + seconds
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except BlockingIOError:
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.05)
    except OSError as e:  # a filesystem without locks: say so rather than run unguarded
      raise UserError(f"--output {output}: cannot lock {path} ({e.strerror}); put --output on a filesystem "
                      f"with locks") from None


class Fence:
  """What a Ray actor checks before each write of progress into ``output``: that the lock is held, and of
  ``gen``, its driver's generation. Picklable (a path and a number): the driver gives it to its actors."""

  def __init__(self, output: str, gen: int):
    self.output, self.gen = os.path.abspath(output), gen

  @contextlib.contextmanager
  def writing(self) -> Iterator[None]:
    """The block of one write, under ``.lock.writers`` shared; `Fenced` (nothing written) when the driver is
    gone or another run holds the folder now."""
    fd = _open(os.path.join(self.output, WRITERS_FILE), "writers' lock file", self.output)
    try:
      fcntl.flock(fd, fcntl.LOCK_SH)
      self.check()
      yield
    finally:
      os.close(fd)

  def check(self) -> None:
    """`Fenced` unless the folder's lock is held, by a run of this generation."""
    fd = _open(os.path.join(self.output, LOCK_FILE), "lock file", self.output)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: nobody holds the folder, the driver is dead
      except BlockingIOError:
        now = _read_body(fd).get("generation")
        if now != self.gen:
          raise Fenced(f"{self.output} is held by another run now (generation {now}, this actor's driver's "
                       f"{self.gen})") from None
        return
      raise Fenced(f"the driver of generation {self.gen} no longer holds {self.output} (it died)")
    finally:
      os.close(fd)
