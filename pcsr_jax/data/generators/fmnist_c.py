"""Fashion-MNIST-C: the 10,000 Fashion-MNIST test images under the 19 corruptions, cached on disk.

The built-in benchmark's data. Each (corruption, severity) pair is one cache
entry: ``<corruption>_<severity>.npy`` (uint8 [n, 32, 32, 3], the first n test
images) plus a JSON record written last, which holds the count, the seeds, the
SHA-256 of the array and a digest of the clean test images it came from. An
entry is trusted only when all of that checks out; a missing record, a
truncated or edited array, or a record from another seed, version or source is
reported and rebuilt. Since every image is seeded on its own
(`corruptions.image_seed`), an entry built for n images extends to more
without changing the first n.

Location: ``--cache-dir``, else ``$PCSR_JAX_CACHE``, else
``$XDG_CACHE_HOME/pcsr-jax`` (``~/.cache/pcsr-jax``), under ``fmnist_c/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from pcsr_jax import files
from pcsr_jax.data import fashion_mnist
from pcsr_jax.data.generators import corruptions
from pcsr_jax.errors import UserError

VERSION = 1  # bump when a corruption function changes: old entries are then rebuilt
CLEAN = "clean"
_CHUNK = 250


def cache_root(cache_dir: Optional[str] = None) -> str:
  if cache_dir:
    return cache_dir
  if os.environ.get("PCSR_JAX_CACHE"):
    return os.environ["PCSR_JAX_CACHE"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "pcsr-jax")


def _sha(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


class Store:
  """Corrupted copies of ``clean`` (the uint8 test images), generated on demand and cached. ``seed``: the
  corruption seed, 0 to 2**32 - 1 (`corruptions.check_seed`)."""

  def __init__(self, clean: np.ndarray, cache_dir: Optional[str] = None, seed: int = 0, log: Callable = print):
    seed = corruptions.check_seed(seed)  # names the cache folder: a one-line error before anything is made
    self.clean, self.seed, self.log = clean, seed, log
    self.dir = os.path.join(cache_root(cache_dir), "fmnist_c", f"v{VERSION}_seed{seed}")
    self.source_digest = _sha(clean)[:16]

  def _paths(self, corruption: str, severity: int) -> tuple[str, str]:
    stem = os.path.join(self.dir, f"{corruption}_{severity}")
    return stem + ".npy", stem + ".json"

  def check(self, corruption: str, severity: int) -> tuple[Optional[np.ndarray], str]:
    """``(images, "")`` for a valid entry, ``(None, why)`` otherwise (``why`` empty when simply absent)."""
    npy, rec = self._paths(corruption, severity)
    if not os.path.exists(rec) and not os.path.exists(npy):
      return None, ""
    try:
      with open(rec) as f:
        meta = json.load(f)
    except (OSError, ValueError):
      return None, f"{rec}: missing or unreadable record"
    want = dict(version=VERSION, corruption=corruption, severity=severity, seed=self.seed,
                source_digest=self.source_digest)
    for k, v in want.items():
      if meta.get(k) != v:
        return None, f"{rec}: {k} is {meta.get(k)!r}, expected {v!r}"
    try:
      images = np.load(npy, allow_pickle=False)
    except (OSError, ValueError) as e:
      return None, f"{npy}: unreadable ({type(e).__name__})"
    n = meta.get("count")
    if images.dtype != np.uint8 or images.shape != (n, *self.clean.shape[1:]):
      return None, f"{npy}: shape {images.shape} {images.dtype}, expected ({n}, 32, 32, 3) uint8"
    if _sha(images) != meta.get("sha256"):
      return None, f"{npy}: checksum mismatch (partial write or edited)"
    return images, ""

  def _write(self, corruption: str, severity: int, images: np.ndarray) -> None:
    os.makedirs(self.dir, exist_ok=True)
    npy, rec = self._paths(corruption, severity)
    if os.path.exists(rec):
      os.remove(rec)  # the record goes last: a crash in between leaves an entry that fails `check`
    with files.atomic_path(npy) as tmp:
      np.save(tmp, images)
    files.write_json(rec, dict(version=VERSION, corruption=corruption, severity=severity, seed=self.seed,
                               source_digest=self.source_digest, count=len(images), sha256=_sha(images)))

  def get_many(self, pairs: Sequence[tuple[str, int]], n: int, progress: bool = True) -> dict:
    """``{(corruption, severity): uint8 [n, 32, 32, 3]}``, generating what the cache lacks."""
    from tqdm import tqdm

    if not 1 <= n <= len(self.clean):
      raise UserError(f"images per corruption: expected 1 to {len(self.clean)}, got {n}")
    for c, s in pairs:  # a bad name or severity: one line before any generating, not midway through
      if c != CLEAN:
        corruptions.params(c, s, "cifar")
    out, todo = {}, []
    for c, s in pairs:
      if c == CLEAN:
        out[(c, s)] = self.clean[:n]
        continue
      images, why = self.check(c, s)
      if why:
        self.log(f"fmnist-c cache: {why}; rebuilding {c} severity {s}")
      have = 0 if images is None else len(images)
      if have >= n:
        out[(c, s)] = images[:n]
      else:
        todo.append((c, s, images, have))
    if todo:
      total = sum(n - have for *_, have in todo)
      self.log(f"fmnist-c cache: generating {total:,} corrupted images into {self.dir} (once; later runs read "
               f"them)")
      t0 = time.monotonic()
      with tqdm(total=total, desc="Fashion-MNIST-C", unit="img", disable=not progress, leave=False) as bar:
        for c, s, images, have in todo:
          parts = [] if images is None else [images]
          for start in range(have, n, _CHUNK):
            stop = min(start + _CHUNK, n)
            parts.append(corruptions.corrupt_batch(self.clean[start:stop], c, s, self.seed, start))
            bar.update(stop - start)
          full = np.concatenate(parts)
          self._write(c, s, full)
          out[(c, s)] = full
      self.log(f"fmnist-c cache: {total:,} images generated in {time.monotonic() - t0:.0f} s")
    return out


class ArraySource:
  """In-memory images in the harness's source interface (``labels``, ``names``, ``load``)."""

  imagenet_labels = False

  def __init__(self, images: np.ndarray, labels: np.ndarray, num_classes: int):
    self.images, self.labels = images, np.asarray(labels, np.int64)
    self.names = [f"test_{i:05d}" for i in range(len(images))]
    self.num_label_classes = num_classes

  def __len__(self) -> int:
    return len(self.images)

  def load(self, i: int) -> np.ndarray:
    return self.images[i]


def sources(corruption_names: Sequence[str], severity: int, n: int, fmnist_dir: Optional[str] = None,
            cache_dir: Optional[str] = None, seed: int = 0, progress: bool = True,
            log: Callable = print) -> list[tuple[str, ArraySource]]:
  """``[(name, source)]`` over the first ``n`` test images, one per corruption (``clean`` allowed;
  names are checked by `harness.RunConfig.validate`)."""
  images, labels = fashion_mnist.load("test", fmnist_dir)
  store = Store(images, cache_dir, seed, log)
  data = store.get_many([(c, severity) for c in corruption_names], n, progress)
  k = len(fashion_mnist.CLASSES)
  return [(c, ArraySource(data[(c, severity)], labels[:n], k)) for c in corruption_names]
