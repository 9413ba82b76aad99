"""The loader's two backends, threads and worker processes: the same batches, skips and order."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax.data import loader, sources, transforms
from pcsr_jax.errors import UserError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A 40-image ImageNet-C folder at 32 px with its 7th file truncated (unreadable)."""
  root = tmp_path_factory.mktemp("loader")
  hf.make_imagenet_c(str(root), ("fog",), classes=4, per_class=10)
  src = sources.imagenet_c_source(str(root), "fog", 5)
  with open(src.paths[6], "r+b") as f:
    f.truncate(40)
  return src


def _batches(src, processes, start_batch=0, rows=None, preprocess=None, workers=2):
  pre = preprocess or transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  ld = loader.Loader([src, src], pre, batch_size=8, workers=workers, processes=processes)
  ids = np.array([0] * 20 + [1] * 20)  # two sources, as the harness's corruptions
  idx = np.concatenate([np.arange(20)[::-1], np.arange(20, 40)])
  try:
    return list(ld.batches(ids, idx, start_batch=start_batch, rows=rows))
  finally:
    ld.close()


def _assert_same(a, b):
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    assert x.images.dtype == y.images.dtype and x.images.shape == y.images.shape
    np.testing.assert_array_equal(x.images, y.images)
    assert x.names == y.names and x.skipped == y.skipped
    np.testing.assert_array_equal(x.labels, y.labels)
    np.testing.assert_array_equal(x.tags, y.tags)
    np.testing.assert_array_equal(x.positions, y.positions)


@pytest.mark.parametrize("start_batch,rows", [(0, None), (1, (3, 7))])
def test_processes_give_the_threads_batches(folder, start_batch, rows):
  threads = _batches(folder, False, start_batch, rows)
  _assert_same(threads, _batches(folder, True, start_batch, rows))
  # The truncated file sits at stream position 13: batch 1, row 5, inside both selections; counted once.
  assert [n for b in threads for n in b.skipped] == [folder.names[6]]
  assert sum(len(b.labels) for b in threads) == (39 if rows is None else 4 * 4 - 1)


def test_processes_carry_float32_images_and_reuse_their_workers(folder):
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True)  # normalized on the host: float32
  ld = loader.Loader([folder], pre, batch_size=8, workers=2, processes=True)
  ids, idx = np.zeros(16, int), np.arange(16)
  try:
    first = list(ld.batches(ids, idx))
    pool = ld._pool
    second = list(ld.batches(ids, idx))
    assert ld._pool is pool  # one pool for every stream of the loader
  finally:
    ld.close()
  assert ld._pool is None
  _assert_same(first, second)
  assert first[0].images.dtype == np.float32
  _assert_same(first, list(loader.Loader([folder], pre, batch_size=8, workers=2).batches(ids, idx)))


class _Unpicklable:
  """A source holding a lock, which pickle refuses."""

  def __init__(self, src):
    self.src, self.labels, self.names = src, src.labels, src.names
    self.lock = threading.Lock()

  def load(self, i):
    return self.src.load(i)


def test_a_source_that_cannot_reach_the_workers_is_one_clear_error(folder):
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  ld = loader.Loader([_Unpicklable(folder)], pre, batch_size=8, workers=2, processes=True)
  with pytest.raises(UserError, match="--loader processes: the data source cannot be sent"):
    list(ld.batches(np.zeros(8, int), np.arange(8)))


class _SlowToStart:
  """A source whose unpickling (in each worker's start-up) takes a second, except in the first worker up; each
  worker writes its pid to ``ready`` once it can take work."""

  def __init__(self, src, marker):
    self.src, self.labels, self.names, self.marker = src, src.labels, src.names, marker

  def __getstate__(self):
    return self.__dict__

  def __setstate__(self, state):
    self.__dict__.update(state)
    try:
      os.close(os.open(self.marker + ".first", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
      import time

      time.sleep(1.0)
    with open(self.marker + ".ready", "a") as f:
      f.write(f"{os.getpid()}\n")

  def load(self, i):
    return self.src.load(i)


def test_start_workers_waits_for_the_last_worker_up(folder, tmp_path):
  # The first worker up could answer one ping per worker alone; the others must still be waited for.
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  marker = str(tmp_path / "w")
  ld = loader.Loader([_SlowToStart(folder, marker)], pre, batch_size=8, workers=3, processes=True)
  try:
    ld.start_workers()
    with open(marker + ".ready") as f:
      ready = set(f.read().split())
    assert ready == {str(p.pid) for p in ld._pool._processes.values()} and len(ready) == 3
  finally:
    ld.close()


def test_throughput_starts_every_worker_and_the_stream_keeps_them(folder):
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  ld = loader.Loader([folder], pre, batch_size=8, workers=2, processes=True)
  try:
    assert ld.throughput(40) > 0
    pool = ld._pool
    assert pool is not None and len(pool._processes) == 2  # both started before the clock
    assert sum(len(b.labels) for b in ld.batches(np.zeros(40, int), np.arange(40))) == 39
    assert ld._pool is pool
  finally:
    ld.close()


def test_start_workers_gives_up_in_one_line_when_the_workers_do_not_come_up(folder, tmp_path):
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  marker = str(tmp_path / "w")
  ld = loader.Loader([_SlowToStart(folder, marker)], pre, batch_size=8, workers=2, processes=True)
  try:
    with pytest.raises(UserError, match=r"--loader processes: [01] of 2 worker processes answered within 0.3 s"):
      ld.start_workers(timeout_s=0.3)  # the second worker takes a second to start
  finally:
    ld.close()


class _CountsPickling:
  """A source that counts how often the parent process pickles it."""

  pickled = 0

  def __init__(self, src):
    self.src, self.labels, self.names = src, src.labels, src.names

  def __len__(self):
    return len(self.src)

  def __getstate__(self):
    type(self).pickled += 1
    return self.__dict__

  def load(self, i):
    return self.src.load(i)


def test_auto_loader_and_workers_pickle_the_sources_once(folder, monkeypatch):
  from pcsr_jax import run_setup

  monkeypatch.setattr(run_setup.jax, "default_backend", lambda: "gpu")  # the rule under `auto` is what is tested
  monkeypatch.setattr(run_setup.os, "cpu_count", lambda: 16)
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  ld = loader.Loader([_CountsPickling(folder)], pre, batch_size=8, workers=2)
  try:
    assert run_setup.loader_kind("auto", ld) == "processes" and _CountsPickling.pickled == 1
    ld.processes = True
    ld.start_workers()
    assert sum(len(b.labels) for b in ld.batches(np.zeros(16, int), np.arange(16))) == 15  # 7th truncated
    assert _CountsPickling.pickled == 1
  finally:
    ld.close()


class _FailingCorruption:
  """A generated source's shape: the clean image read (an unreadable one raises `sources.Unreadable`), then a
  corruption step that fails on item 3 as numpy's Poisson did at severity 1e-300. Module-level: worker
  processes unpickle it."""

  def __init__(self, src):
    self.src, self.labels, self.names = src, src.labels, src.names

  def __len__(self):
    return len(self.src)

  def load(self, i):
    img = self.src.load(i)
    if i == 3:
      raise ValueError("lam value too large")
    return img


@pytest.mark.parametrize("processes", [False, True])
def test_a_failing_corruption_is_raised_not_counted_as_unreadable(folder, processes):
  """Before, every exception of ``load`` + preprocess counted as an unreadable image, so a corruption's failure
  (a bad seed, ``lam value too large``) ended runs with "no image ... was evaluated (80 unreadable)"."""
  with pytest.raises(ValueError, match="^lam value too large$"):
    _batches(_FailingCorruption(folder), processes)


def test_generated_source_counts_unreadable_clean_files_and_raises_corruption_failures(folder, monkeypatch):
  from pcsr_jax.data.generators import corruptions, generated

  src = generated.CorruptedSource(folder, "contrast", 3)
  out = _batches(src, False)
  assert [n for b in out for n in b.skipped] == [folder.names[6]] and sum(len(b.labels) for b in out) == 39

  def broken(x, c):
    raise ValueError("expected non-negative integer")  # SeedSequence's message for a negative seed

  monkeypatch.setitem(corruptions.FUNCTIONS["imagenet"], "contrast", broken)
  with pytest.raises(ValueError, match="^expected non-negative integer$"):
    _batches(src, False)


def test_only_read_and_decode_failures_are_unreadable(folder, tmp_path):
  """`sources.read_image` / `decode_image`: a missing, truncated, non-image or non-regular file is `Unreadable`
  (naming the file); a readable one loads."""
  assert sources.read_image(folder.paths[0]).size == (32, 32)
  garbage = tmp_path / "garbage.JPEG"
  garbage.write_bytes(b"not an image at all")
  fifo = tmp_path / "fifo.JPEG"
  os.mkfifo(fifo)
  for path in (folder.paths[6], str(garbage), str(tmp_path / "missing.JPEG"), str(fifo), str(tmp_path)):
    with pytest.raises(sources.Unreadable, match=f"^{path}: "):
      sources.read_image(path)
  with pytest.raises(sources.Unreadable, match="^record 7: UnidentifiedImageError"):
    sources.decode_image(b"\x89PNG broken", "record 7")
  with open(folder.paths[0], "rb") as f:
    data = f.read()
  assert sources.decode_image(data, "x").size == (32, 32)
  with pytest.raises(sources.Unreadable, match="^record 8: OSError: image file is truncated"):
    sources.decode_image(data[:len(data) // 2], "record 8")
