"""Files replaced atomically: a reader, a resumed run or a crash never sees half of one.

Every cache entry, saved progress and result file is written to a temporary name beside its final one (same
folder, so the rename stays on one filesystem) and renamed over it only once complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Iterable, Iterator, Optional


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


def check_output_dir(path: str, flag: str = "--output", beside: bool = False) -> None:
  """``path`` can become or already is a writable folder: nothing but folders along it and the nearest existing
  one writable; else a one-line `UserError` naming ``flag``. ``beside``: the command also writes next to
  ``path`` (a temporary folder it renames over ``path``), so ``path``'s parent must be writable too. Checked
  before any work, so that training does not end in a `NotADirectoryError`; it creates nothing, so a command
  that stops later on other bad input leaves no empty folder behind."""
  from pcsr_jax.errors import UserError

  if not path:
    raise UserError(f"{flag}: empty path")
  if os.path.lexists(path) and not os.path.isdir(path):
    raise UserError(f"{flag} {path}: exists and is not a directory")
  must_write = [os.path.abspath(path)] + ([os.path.dirname(os.path.abspath(path))] if beside else [])
  for target in must_write:
    above = target
    while not os.path.lexists(above):
      above = os.path.dirname(above)
    if not os.path.isdir(above):
      raise UserError(f"{flag} {path}: {above} exists and is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
      raise UserError(f"{flag} {path}: {above} is not writable")


def refuse_links(folder: str, names: Iterable[str], walk: Iterable[str] = (), flag: str = "--output") -> None:
  """A one-line `UserError` naming ``flag`` if any of ``names`` in ``folder`` (the files and folders a command
  writes there), or anything under the folders among them named in ``walk``, is a symbolic link: the command
  would write through it, outside ``folder``. The folder itself may be a link (the user's choice); what the
  command makes in it may not."""
  from pcsr_jax.errors import UserError

  def refuse(path: str) -> None:
    raise UserError(f"{flag} {folder}: {path} is a symbolic link (to {os.readlink(path)}); the run writes there and "
                    f"follows no link out of {flag}: remove it, or give another {flag}")

  for name in names:
    path = os.path.join(folder, name)
    if os.path.islink(path):
      refuse(path)
    if name in walk and os.path.isdir(path):
      for top, dirs, found in os.walk(path):  # a link to a folder is listed in dirs, never entered
        for n in dirs + found:
          if os.path.islink(os.path.join(top, n)):
            refuse(os.path.join(top, n))


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


def save_tree(directory: str, tree: Any, meta: dict) -> None:
  """A host pytree of arrays (a trainer's state) and its ``meta`` as one ``directory/state.npz`` (the leaves in
  order, the meta as JSON inside, so the two can never be of different steps), replaced atomically, and a copy of
  the meta in ``directory/state.json`` for people and existence checks: what a training script's ``--resume``
  reads back with `load_tree`."""
  import jax
  import numpy as np

  os.makedirs(directory, exist_ok=True)
  leaves = jax.tree.leaves(tree)
  meta = dict(meta, leaves=len(leaves))
  with atomic_path(os.path.join(directory, "state.npz")) as tmp:
    np.savez(tmp, *leaves, meta=np.asarray(json.dumps(meta)))
  write_json(os.path.join(directory, "state.json"), meta)


def load_tree(directory: str, template: Any, fmt: str) -> tuple[Any, dict]:
  """`save_tree`'s ``(tree, meta)`` in the structure of ``template`` (a tree of the same leaf shapes and dtypes),
  checked: the meta's ``format`` must be ``fmt`` and the leaves must match; else a one-line `UserError`."""
  import jax
  import numpy as np

  from pcsr_jax.errors import UserError

  try:
    leaves, treedef = jax.tree.flatten(template)
    with np.load(os.path.join(directory, "state.npz")) as z:
      meta = json.loads(str(z["meta"]))
      saved = [z[f"arr_{i}"] for i in range(len(z.files) - 1)]
    if meta.get("format") != fmt or len(saved) != len(leaves) or any(
        a.shape != np.shape(b) or a.dtype != np.asarray(b).dtype for a, b in zip(saved, leaves)):
      raise ValueError("another run's state")
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(f"{directory}: saved state is damaged or missing ({type(e).__name__}); rerun without --resume "
                    f"to start over") from None
  return jax.tree.unflatten(treedef, saved), meta


def save_trainer(directory: str, trainer: Any, fmt: str, meta: dict) -> None:
  """A training script's trainer (``host_state()``: its state as host arrays) saved with `save_tree`, its meta
  marked with the script's state format ``fmt``."""
  save_tree(directory, trainer.host_state(), dict(meta, format=fmt))


def load_trainer(directory: str, trainer: Any, fmt: str) -> dict:
  """Restores `save_trainer`'s state into ``trainer`` (``load_state(tree)``; a one-line `UserError` if missing,
  damaged or of another format) and returns its meta."""
  tree, meta = load_tree(directory, trainer.host_state(), fmt)
  trainer.load_state(tree)
  return meta
