"""One writer per output folder: a run holds ``<output>/.lock`` (an exclusive ``flock``) from before it reads or
discards any progress there until it has written its outputs, and writes its holder (host, pid, start time)
into it. A second run on the same folder, on this host or on another that shares the folder, is refused in one
line naming the holder, instead of running the table again and discarding the first run's progress under it.

``flock`` locks go with the process: a run that is killed leaves no stale lock behind (the file stays, unlocked,
and the next run takes it). On NFS, Linux maps ``flock`` onto the server's byte-range locks, so hosts sharing
the folder see each other's lock.

The lock file is opened without following a link (``O_NOFOLLOW``) and must be a regular file with one name: the
run truncates and writes it, and writes nothing outside its output folder through a link there.
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
from typing import Iterator

from pcsr_jax.errors import UserError

LOCK_FILE = ".lock"


def holder(output: str) -> str:
  """Who holds (or last held) ``output``'s lock, as the refusal names it: ``host:pid since <time>``."""
  try:
    with open(os.path.join(output, LOCK_FILE)) as f:
      who = json.load(f)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(who["since"])))
    return f"{who['host']}:{who['pid']} (since {since}: {who.get('command', '')})".replace(": )", ")")
  except (OSError, ValueError, KeyError, TypeError):
    return "another run (its holder file is unreadable)"


def _open(output: str, path: str) -> int:
  """``path`` opened for the lock, never through a link: a symbolic link there (``O_NOFOLLOW``), anything but a
  regular file, or a file with other names (a hard link) is a `UserError`, since the run truncates and writes it
  and must write nothing outside ``output``."""
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise UserError(f"--output {output}: its lock file {path} is a symbolic link; the run writes its lock there "
                      f"and follows no link out of --output: remove the link") from None
    odd = e.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP)  # a folder, a socket, a device there
    raise UserError(f"--output {output}: cannot open its lock file {path} ({e.strerror})"
                    + ("; it must be a regular file, or absent" if odd else "")) from None
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
    os.close(fd)
    what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
    raise UserError(f"--output {output}: its lock file {path} is {what}; the run writes its lock there: remove "
                    f"it") from None
  return fd


# The folders this process holds, with how many blocks hold each: a command that holds its output around its
# runs (the built-in benchmark's header goes into log.txt first) and the run inside it share the one lock.
_HELD: dict[str, int] = {}


@contextlib.contextmanager
def hold(output: str, command: str = "") -> Iterator[None]:
  """Holds ``output``'s lock for the block (again inside a block of this process that holds it); a folder another
  run holds is a `UserError` naming the holder."""
  try:
    os.makedirs(output, exist_ok=True)
  except OSError as e:
    raise UserError(f"--output {output}: cannot make the folder ({e.strerror or type(e).__name__})") from None
  path = os.path.join(output, LOCK_FILE)
  key = os.path.realpath(path)
  if key in _HELD:
    _HELD[key] += 1
    try:
      yield
    finally:
      _HELD[key] -= 1
    return
  fd = _open(output, path)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise UserError(f"--output {output}: in use by the run {holder(output)}; wait for it to end, or give "
                      f"another --output") from None
    except OSError as e:  # a filesystem without locks: say so rather than run unguarded
      raise UserError(f"--output {output}: cannot lock {path} ({e.strerror}); put --output on a filesystem "
                      f"with locks") from None
    body = json.dumps(dict(host=socket.gethostname(), pid=os.getpid(), since=time.time(), command=command))
    os.ftruncate(fd, 0)
    os.pwrite(fd, body.encode(), 0)
    _HELD[key] = 1
    try:
      yield
    finally:
      del _HELD[key]
  finally:
    os.close(fd)  # releases the lock
