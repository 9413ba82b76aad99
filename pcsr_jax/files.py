"""Files replaced atomically: a reader, a resumed run or a crash never sees half of one.

Every cache entry, saved progress and result file is written to a temporary name beside its final one (same
folder, so the rename stays on one filesystem) and renamed over it only once complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Iterator, Optional


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """A temporary path to write ``path``'s new content to; renamed over ``path`` when the block ends without an
  error, removed when it raises. It keeps ``path``'s extension (``np.save``/``np.savez`` append theirs
  otherwise) and carries the process id (several processes may write the same cache)."""
  root, ext = os.path.splitext(path)
  tmp = f"{root}.tmp{os.getpid()}{ext}"
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_json(path: str, obj: Any, indent: Optional[int] = None) -> None:
  """``obj`` as JSON at ``path``, atomically."""
  with atomic_path(path) as tmp, open(tmp, "w") as f:
    json.dump(obj, f, indent=indent)


def sha256(path: str) -> str:
  """The SHA-256 of a file's bytes (read in 1 MiB chunks): what a cache entry or an asset's record checks."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()
