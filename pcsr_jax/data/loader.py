"""Parallel decoding with prefetch: threads or worker processes decode and preprocess ahead of the step.

``prefetch`` batches are in flight while the accelerator runs the current step, so the step does not wait on
decoding unless decoding is the bottleneck. An unreadable or truncated image -- a source's ``load`` raising
`sources.Unreadable` -- is skipped and counted (`Batch.skipped`), and the stream goes on. Anything else raised
while loading or preprocessing an image (a generated source's corruption failing, a bad seed, a bug) is not an
unreadable image: it ends the stream as the error it is, with its message.

Two backends give the same batches. Threads (the default) share the process: PIL's JPEG decode releases the
GIL, but the rest of each image's work (PIL's header parsing in Python, the copies into numpy) holds it,
about half of a 224 px ImageNet-C image's time on this project's CPU, so threads stop scaling after a few
cores (on a 16-core GPU host they decoded no faster than one core here). ``processes=True`` decodes in
``workers`` spawned processes that write each batch's rows straight into shared memory, so nothing
serializes them; they cost a start-up (the sources are sent once per worker) and need picklable sources.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import copy
import dataclasses
import multiprocessing
import os
import pickle
import signal
import time
from multiprocessing import shared_memory
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from pcsr_jax.data.sources import Unreadable
from pcsr_jax.errors import UserError


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
  on the device by the engine) or a `Preprocess` itself (float32, normalized on the host). ``processes``:
  decode in ``workers`` processes instead of threads (module doc); they start on first use and stop with
  `close` (or at exit).
  """

  def __init__(self, sources: Sequence, preprocess: Callable, batch_size: int, workers: Optional[int] = None,
               prefetch: int = 2, processes: bool = False):
    self.sources, self.preprocess, self.batch_size = sources, preprocess, batch_size
    self.workers = workers or default_workers()
    self.prefetch = max(1, prefetch)
    self.processes = processes
    self._pool: Optional[cf.ProcessPoolExecutor] = None
    self._payload: Optional[bytes] = None

  def decode(self, source_id: int, index: int) -> Optional[np.ndarray]:
    """One preprocessed image, or None if it cannot be read (`sources.Unreadable`); other errors propagate."""
    try:
      img = self.sources[source_id].load(int(index))
    except Unreadable:  # unreadable / truncated file: skipped and counted by the caller
      return None
    return self.preprocess(img)

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
    spans = [(s + lo, min(s + hi, s + self.batch_size, n))
             for s in range(start_batch * self.batch_size, n, self.batch_size)]
    items = [list(zip(source_ids[a:b], indices[a:b])) for a, b in spans]
    if self.processes:
      # The layout of the shared-memory rows, from the first readable image of the first batch (none: threads).
      first = next((img for sid, idx in (items[0] if items else []) for img in [self.decode(sid, idx)]
                    if img is not None), None)
      if first is not None:
        yield from self._process_batches(items, lo, first.shape, first.dtype)
        return
    with cf.ThreadPoolExecutor(self.workers) as pool:
      pending: collections.deque = collections.deque()
      for batch in items[:self.prefetch]:
        pending.append([pool.submit(self._load, it) for it in batch])
      for k in range(len(items)):
        if k + self.prefetch < len(items):
          pending.append([pool.submit(self._load, it) for it in items[k + self.prefetch]])
        loaded = [f.result() for f in pending.popleft()]
        ok = [r[0] is not None for r in loaded]
        shape = next((r[0].shape for r in loaded if r[0] is not None), (0,))
        images = (np.stack([r[0] for r in loaded if r[0] is not None]) if any(ok)
                  else np.zeros((0,) + shape[1:], np.float32))
        yield self._batch(images, [r[1:] for r in loaded], ok, lo)

  def _batch(self, images: np.ndarray, meta: list, ok: list[bool], lo: int) -> Batch:
    """A `Batch` of the decoded rows ``images`` given every item's ``(label, name, source id)``."""
    kept = [m for m, good in zip(meta, ok) if good]
    return Batch(images=images, labels=np.asarray([m[0] for m in kept], np.int32), names=[m[1] for m in kept],
                 tags=np.asarray([m[2] for m in kept], np.int32),
                 skipped=[m[1] for m, good in zip(meta, ok) if not good],
                 positions=np.asarray([lo + i for i, good in enumerate(ok) if good], np.int64))

  def payload(self) -> bytes:
    """``(sources, preprocess)`` pickled as each worker process receives them at start-up; made once per loader
    and kept, so that asking whether the sources can reach a worker (`run_setup.loader_kind`) and starting the
    workers pickle them once between them (all 15 ImageNet-C corruptions' 750,000 paths: 0.3 s).
    `UserError` when they cannot be pickled (a source holding a lock or an open handle)."""
    if self._payload is None:
      try:
        self._payload = pickle.dumps((self.sources, self.preprocess))
      except Exception as e:
        raise UserError(f"--loader processes: the data source cannot be sent to worker processes "
                        f"({type(e).__name__}: {e}); use --loader threads") from None
    return self._payload

  def _process_pool(self) -> cf.ProcessPoolExecutor:
    if self._pool is None:
      payload = self.payload()
      # spawn, not fork: the parent runs JAX's threads, which a forked child would inherit mid-flight.
      self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                          initializer=_worker_init, initargs=(payload,))
    return self._pool

  def _process_batches(self, items: list, lo: int, shape: tuple, dtype) -> Iterator[Batch]:
    pool = self._process_pool()
    rows = max(len(b) for b in items)
    # Each task decodes a few rows of one batch; enough tasks per batch for every worker, not so many that
    # the per-task messages cost.
    chunk = max(1, -(-rows // (2 * self.workers)))
    layout = ((rows,) + tuple(shape), np.dtype(dtype).str)
    nbytes = max(1, int(np.prod(layout[0])) * np.dtype(dtype).itemsize)
    slots = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(self.prefetch + 1)]
    try:
      pending: collections.deque = collections.deque()

      def submit(k):
        name = slots[k % len(slots)].name
        pending.append([pool.submit(_worker_decode, name, layout, j, items[k][j:j + chunk])
                        for j in range(0, len(items[k]), chunk)])

      for k in range(min(self.prefetch, len(items))):
        submit(k)
      for k in range(len(items)):
        if k + self.prefetch < len(items):
          submit(k + self.prefetch)  # into the slot the batch before this one used: it was copied out
        loaded = [r for f in pending.popleft() for r in f.result()]
        ok = [r[0] for r in loaded]
        view = np.ndarray(layout[0], dtype, buffer=slots[k % len(slots)].buf)
        yield self._batch(view[:len(ok)][np.asarray(ok, bool)], [r[1:] for r in loaded], ok, lo)
    finally:
      for f in (f for fs in pending for f in fs):
        f.cancel()
      for f in (f for fs in pending for f in fs):
        if not f.cancelled():
          f.exception()  # a running task still writes into its slot: let it finish before the slot goes
      for slot in slots:
        slot.close()
        slot.unlink()

  def throughput(self, n: int = 256) -> float:
    """Images/s of decode + preprocess over the first ``n`` items of the first source, in batches of 64 (worker
    processes are started, and sent the sources, before the clock starts; they stay for the stream)."""
    items = np.arange(min(n, len(self.sources[0])))
    if self.processes:
      self.start_workers()
    timed = copy.copy(self)  # the same workers
    timed.batch_size = 64
    t0 = time.perf_counter()
    count = sum(len(b.labels) for b in timed.batches(np.zeros_like(items), items))
    return count / max(time.perf_counter() - t0, 1e-9)

  def start_workers(self, timeout_s: float = 300.0) -> None:
    """Starts every worker process and waits until each has answered, so no later batch (or timing) waits on a
    start-up. One ping per worker is not enough: spawned workers come up over seconds, the first ones up answer
    the pings of the rest, and the clock then ran over the others' start-ups (an H200 host's 16 workers:
    55 img/s over 256 images, against 5,109 once the stream ran). So pings go round until every pid has
    answered; each is held 20 ms, so that one worker cannot answer a whole round alone."""
    pool, seen = self._process_pool(), set()
    deadline = time.monotonic() + timeout_s
    try:
      while len(seen) < self.workers:
        left = deadline - time.monotonic()
        if left <= 0:
          raise cf.TimeoutError
        seen.update(pool.map(_worker_ping, [0.02] * self.workers, timeout=left))
    except cf.TimeoutError:
      raise UserError(f"--loader processes: {len(seen)} of {self.workers} worker processes answered within "
                      f"{timeout_s:g} s; use fewer --workers or --loader threads") from None

  def close(self) -> None:
    """Stops the worker processes, if any were started."""
    if self._pool is not None:
      self._pool.shutdown(cancel_futures=True)
      self._pool = None


# Worker-process side of ``processes=True``: the sources and preprocess arrive once, at start-up.
_WORKER: dict = {}


def _worker_init(payload: bytes) -> None:
  # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the parent saves its progress at the next
  # batch (`harness._Stop`), which needs its workers alive. A worker ends when the parent closes the pool or dies.
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  _WORKER["sources"], _WORKER["preprocess"] = pickle.loads(payload)
  _WORKER["slots"] = {}


def _attach(name: str) -> shared_memory.SharedMemory:
  """The parent's shared memory ``name``; the parent alone unlinks it. (Before Python 3.13 attaching also
  registers it with the resource tracker, which spawned workers share with the parent: a no-op there.)"""
  try:
    return shared_memory.SharedMemory(name=name, track=False)
  except TypeError:
    return shared_memory.SharedMemory(name=name)


def _worker_ping(hold_s: float) -> int:
  """This worker's pid, after ``hold_s`` (`Loader.start_workers`)."""
  time.sleep(hold_s)
  return os.getpid()


def _worker_decode(slot: str, layout: tuple, row0: int, items: list) -> list[tuple]:
  """Decodes ``items`` into rows ``row0..`` of the shared-memory batch ``slot``: ``(ok, label, name, source)``
  per item, as `Loader._load` (an unreadable image, or one that comes out in another shape, is skipped; any
  other error propagates to the parent through the task's future)."""
  shms = _WORKER["slots"]
  if slot not in shms:
    if len(shms) >= 8:  # slots of finished `batches` calls: the parent unlinked them
      for old in list(shms)[:-4]:
        shms.pop(old).close()
    shms[slot] = _attach(slot)
  shape, dtype = layout
  out = np.ndarray(shape, np.dtype(dtype), buffer=shms[slot].buf)
  result = []
  for k, (sid, idx) in enumerate(items):
    src = _WORKER["sources"][sid]
    try:
      loaded = src.load(int(idx))
    except Unreadable:  # unreadable / truncated: skipped, as on the thread path
      loaded = None
    img = None if loaded is None else _WORKER["preprocess"](loaded)
    ok = img is not None and img.shape == shape[1:]
    if ok:
      out[row0 + k] = img
    result.append((ok, int(src.labels[idx]), src.names[idx], int(sid)))
  return result


def decode_throughput(sources, preprocess, n: int = 256, workers: Optional[int] = None,
                      processes: bool = False) -> float:
  """`Loader.throughput` of a loader of ``sources``, closed afterwards."""
  loader = Loader(sources, preprocess, batch_size=64, workers=workers, processes=processes)
  try:
    return loader.throughput(n)
  finally:
    loader.close()
