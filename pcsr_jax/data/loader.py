"""Parallel decoding with prefetch: a thread pool decodes and preprocesses ahead of the step.

PIL's decode and resize release the GIL, so threads scale over cores without
pickling images between processes. ``prefetch`` batches are in flight while the
accelerator runs the current step, so the step does not wait on decoding unless
decoding is the bottleneck. An unreadable or truncated image is skipped and
counted (`Batch.skipped`), and the stream goes on.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import os
import time
from typing import Callable, Iterator, Optional, Sequence

import numpy as np


@dataclasses.dataclass
class Batch:
  images: np.ndarray  # [n, H, W, 3] as ``preprocess`` returns it, n <= batch size (skipped images removed)
  labels: np.ndarray  # [n] int32
  names: list[str]
  tags: np.ndarray  # [n] int32: which segment part (corruption) each image came from
  skipped: list[str]  # names of unreadable images in this batch
  positions: Optional[np.ndarray] = None  # [n] where each image sits among the batch's items (before skipping)


def default_workers() -> int:
  return max(1, min(32, (os.cpu_count() or 1)))


class Loader:
  """Iterates batches of ``items`` (``(source_id, index)`` pairs) in order.

  ``preprocess`` maps a loaded image to an HWC array: `Preprocess.to_uint8` (the harness: uint8, normalized
  on the device by the engine) or a `Preprocess` itself (float32, normalized on the host).
  """

  def __init__(self, sources: Sequence, preprocess: Callable, batch_size: int, workers: Optional[int] = None,
               prefetch: int = 2):
    self.sources, self.preprocess, self.batch_size = sources, preprocess, batch_size
    self.workers = workers or default_workers()
    self.prefetch = max(1, prefetch)

  def decode(self, source_id: int, index: int) -> Optional[np.ndarray]:
    """One preprocessed image, or None if it cannot be read."""
    try:
      return self.preprocess(self.sources[source_id].load(int(index)))
    except Exception:  # unreadable / truncated file: skipped and counted by the caller
      return None

  def _load(self, item):
    sid, idx = item
    src = self.sources[sid]
    return self.decode(sid, idx), int(src.labels[idx]), src.names[idx], sid

  def batches(self, source_ids: np.ndarray, indices: np.ndarray, start_batch: int = 0,
              rows: Optional[tuple[int, int]] = None) -> Iterator[Batch]:
    """Batches of ``batch_size`` items from ``start_batch`` on. ``rows=(lo, hi)`` decodes only the items at
    positions ``lo <= i < hi`` of each batch (a process's share under `jax.distributed`); `Batch.positions`
    says which of them came back."""
    n = len(indices)
    lo, hi = rows or (0, self.batch_size)
    starts = list(range(start_batch * self.batch_size, n, self.batch_size))
    with cf.ThreadPoolExecutor(self.workers) as pool:
      pending: collections.deque = collections.deque()

      def submit(s):
        a, b = s + lo, min(s + hi, s + self.batch_size, n)
        items = list(zip(source_ids[a:b], indices[a:b]))
        pending.append([pool.submit(self._load, it) for it in items])

      for s in starts[:self.prefetch]:
        submit(s)
      for k in range(len(starts)):
        if k + self.prefetch < len(starts):
          submit(starts[k + self.prefetch])
        loaded = [f.result() for f in pending.popleft()]
        ok = [r for r in loaded if r[0] is not None]
        shape = (0,) if not ok else ok[0][0].shape
        yield Batch(images=np.stack([r[0] for r in ok]) if ok else np.zeros((0,) + shape[1:], np.float32),
                    labels=np.asarray([r[1] for r in ok], np.int32), names=[r[2] for r in ok],
                    tags=np.asarray([r[3] for r in ok], np.int32), skipped=[r[2] for r in loaded if r[0] is None],
                    positions=np.asarray([lo + i for i, r in enumerate(loaded) if r[0] is not None], np.int64))


def decode_throughput(sources, preprocess, n: int = 256, workers: Optional[int] = None) -> float:
  """Images/s of decode + preprocess with ``workers`` threads over the first ``n`` items."""
  items = [(0, i) for i in range(min(n, len(sources[0])))]
  loader = Loader(sources, preprocess, batch_size=64, workers=workers)
  t0 = time.perf_counter()
  count = sum(len(b.labels) for b in loader.batches(np.array([s for s, _ in items]), np.array([i for _, i in items])))
  return count / max(time.perf_counter() - t0, 1e-9)
