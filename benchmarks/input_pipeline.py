"""Decode + preprocess throughput of the input pipeline: uint8 vs float32 output, our threads, our processes, grain.

    python -m benchmarks.input_pipeline [--images 256] [--workers 1,2] [--repeats 3] [--no-grain]

Generates ``--images`` 224 px noise JPEGs in ImageNet-C's folder layout (as `end_to_end.py` does) and, when
TFDS can write one offline, the same JPEGs as a TFDS ``imagenet2012_corrupted/fog_5`` array_record dataset
read with ``tfds.data_source`` (`sources.TFDSSource`). Then, for each path, output dtype and worker count,
it times one full pass (best of ``--repeats``) of

* ``loader``: `pcsr_jax.data.loader.Loader` (the harness's thread pool), batches of 64, in order;
* ``loader-procs``: the same with ``processes=True`` (the harness's ``--loader processes``; worker start-up
  included, which the harness pays once per run);
* ``loader-procs-started``: the same with every worker up before the clock (`Loader.start_workers`, as the
  harness does before its stream): the steady rate. "After 1st batch" is not one: spawned workers come up over
  seconds, and the first batch can be done by the first ones up (16 workers on an H200 host: 1,599 img/s after
  the 1st batch);
* ``grain-threads``: ``grain.MapDataset.source(...).map(load).to_iter_dataset(ReadOptions(num_threads=w))
  .batch(64)``;
* ``grain-procs``: the same with ``.mp_prefetch(MultiprocessingOptions(num_workers=w))`` before the batch
  (worker start-up included: the harness starts a new pass for every domain and method),

all with the ImageNet-C preprocessing (`transforms.imagenet_c_preprocess`: the 224 px center crop) and the
same output, which the script checks (same images, same order). img/s with 1 worker is the per-core figure.
grain is optional (``pip install grain``); the script also reports how grain treats an unreadable image.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np


from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser

BATCH = 64


def make_tfds(folder_source, data_dir: str) -> str | None:
  """The folder's JPEG bytes as a TFDS array_record dataset; None (with the reason printed) when TFDS cannot
  build one here (it needs no TensorFlow, but some TFDS versions need more packages to write)."""
  try:
    import tensorflow_datasets as tfds

    class Imagenet2012Corrupted(tfds.core.GeneratorBasedBuilder, skip_registration=True):
      VERSION = tfds.core.Version("3.1.0")
      BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="fog_5")]
      code_path = None  # an ad-hoc builder: no checksums file to look for

      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(dict(
            image=tfds.features.Image(encoding_format="jpeg"), label=tfds.features.ClassLabel(num_classes=1000),
            file_name=tfds.features.Text())))

      def _split_generators(self, dl_manager):
        return {"validation": self._generate_examples()}

      def _generate_examples(self):
        for path, name, label in zip(folder_source.paths, folder_source.names, folder_source.labels):
          with open(path, "rb") as f:
            yield name, dict(image=f.read(), label=int(label), file_name=os.path.basename(name))

    builder = Imagenet2012Corrupted(config="fog_5", data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return data_dir
  except Exception as e:  # noqa: BLE001 -- an optional measurement
    print(f"TFDS path skipped: cannot build a local TFDS dataset ({type(e).__name__}: {e})")
    return None


def run_loader(src, fn: Callable, workers: int, processes: bool = False,
               started: bool = False) -> tuple[np.ndarray, list[str], float, float]:
  """One pass of `Loader`; ``started``: its worker processes are up before the clock (`Loader.start_workers`)."""
  from pcsr_jax.data.loader import Loader

  loader = Loader([src], fn, BATCH, workers=workers, processes=processes)
  try:
    if started:
      loader.start_workers()
    t0, images, names, first = time.perf_counter(), [], [], None
    for b in loader.batches(np.zeros(len(src), np.int64), np.arange(len(src))):
      images.append(b.images)
      names += b.names
      first = first or time.perf_counter() - t0
    secs = time.perf_counter() - t0  # worker shutdown (``close``) is not part of the pass
  finally:
    loader.close()
  return np.concatenate(images), names, first, secs


def _grain_dataset(src, fn: Callable):
  import grain

  def load(i):
    return fn(src.load(int(i))), int(i)

  return grain.MapDataset.range(len(src)).map(load)


def run_grain(src, fn: Callable, workers: int, processes: bool) -> tuple[np.ndarray, list[str], float, float]:
  import grain

  ds = _grain_dataset(src, fn)
  if processes:
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags: parse none
      flags.FLAGS.mark_as_parsed()
    ds = ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  else:
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=workers, prefetch_buffer_size=2 * BATCH))
  t0, images, names, first = time.perf_counter(), [], [], None
  for x, idx in ds.batch(BATCH):
    images.append(x)
    names += [src.names[i] for i in idx]
    first = first or time.perf_counter() - t0
  return np.concatenate(images), names, first, time.perf_counter() - t0


def time_pass(run: Callable, repeats: int) -> tuple[float, float, tuple]:
  """(img/s of a whole pass, img/s after the first batch, output) of the fastest of ``repeats`` passes; ``run``
  returns ``(images, names, seconds to the first batch, seconds to the last)``."""
  best, out = None, None
  for _ in range(repeats):
    out = run()
    n, first, secs = len(out[1]), out[2], out[3]
    rates = (n / secs, (n - BATCH) / max(secs - first, 1e-9) if n > BATCH else float("nan"))
    best = rates if best is None or rates[0] > best[0] else best
  return best[0], best[1], out


def unreadable_behaviour(src, fn: Callable) -> list[str]:
  """What each pipeline does with one corrupt JPEG in a stream of 8."""
  import grain

  lines = []
  _, names, _, _ = run_loader(src, fn, 2)
  lines.append(f"loader: {len(names)} of {len(src)} images, the corrupt one skipped and counted (Batch.skipped), "
               f"order kept: {names == [n for n in src.names if 'corrupt' not in n]}")
  try:
    run_grain(src, fn, 2, processes=False)
    lines.append("grain-threads: no error")
  except Exception as e:  # noqa: BLE001 -- the behaviour being reported
    lines.append(f"grain-threads: the pass stops with {type(e).__name__} (a map that raises ends the iterator)")

  def load_or_none(i):
    try:
      return fn(src.load(int(i))), int(i)
    except Exception:  # noqa: BLE001
      return None

  out = list(grain.MapDataset.range(len(src)).map(load_or_none).to_iter_dataset().batch(BATCH))
  n = sum(len(idx) for _, idx in out)
  lines.append(f"grain-threads with a map returning None: {n} of {len(src)} images, the corrupt one dropped "
               f"silently (no count unless the map records it)")
  return lines


class _Corrupt:
  """A folder source with one truncated JPEG appended."""

  def __init__(self, src, path: str):
    with open(src.paths[0], "rb") as f:
      data = f.read()
    with open(path, "wb") as f:
      f.write(data[:len(data) // 3])
    self.paths = src.paths[:7] + [path]
    self.names = src.names[:7] + ["corrupt.JPEG"]
    self.labels = np.concatenate([src.labels[:7], src.labels[:1]])

  def __len__(self):
    return len(self.paths)

  def load(self, i):
    from pcsr_jax.data import sources

    return sources.read_image(self.paths[i])  # the truncated file: `sources.Unreadable`, skipped and counted


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="input_pipeline.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=256)
  p.add_argument("--workers", default="1,2")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--no-grain", action="store_true")
  a = p.parse_args(argv)
  from tests import harness_fixtures
  from pcsr_jax.data import sources, transforms

  try:
    import grain  # noqa: F401

    use_grain = not a.no_grain
  except ImportError:
    use_grain = False
    print("grain not installed: timing the thread pool only")
  workers = [int(w) for w in a.workers.split(",")]
  pre = transforms.imagenet_c_preprocess(dict(img_size=224, mean=(0.5,) * 3, std=(0.5,) * 3,
                                              interpolation="bicubic", crop_pct=0.9))
  outputs = {"uint8": pre.to_uint8, "float32": pre}
  with tempfile.TemporaryDirectory() as d:
    harness_fixtures.make_imagenet_c(os.path.join(d, "data"), corruptions=("fog",), classes=4,
                                     per_class=-(-a.images // 4), size=224)
    folder = sources.imagenet_c_source(os.path.join(d, "data"), "fog", 5)
    paths = {"folder": folder}
    if make_tfds(folder, os.path.join(d, "tfds")):
      paths["tfds"] = sources.TFDSSource("fog", 5, data_dir=os.path.join(d, "tfds"))
    print(f"{len(folder)} noise JPEGs at 224 px; {os.cpu_count()} CPU cores; best of {a.repeats} passes; "
          f"batch {BATCH}")
    print("| path | output | pipeline | workers | img/s | img/s after 1st batch | same output |\n"
          "|---|---|---|---|---|---|---|")
    for path, src in paths.items():
      for out_name, fn in outputs.items():
        ref = None
        for w in workers:
          runs = {"loader": lambda: run_loader(src, fn, w),
                  "loader-procs": lambda: run_loader(src, fn, w, processes=True),
                  "loader-procs-started": lambda: run_loader(src, fn, w, processes=True, started=True)}
          if use_grain:
            runs["grain-threads"] = lambda: run_grain(src, fn, w, processes=False)
            runs["grain-procs"] = lambda: run_grain(src, fn, w, processes=True)
          for name, run in runs.items():
            ips, steady, (images, names, _, _) = time_pass(run, a.repeats)
            ref = images if ref is None else ref
            same = names == src.names and images.dtype == ref.dtype and np.array_equal(images, ref)
            print(f"| {path} | {out_name} | {name} | {w} | {ips:.0f} | {steady:.0f} | {'yes' if same else 'NO'} |",
                  flush=True)
    if use_grain:
      print("\nunreadable image (1 truncated JPEG of 8):")
      for line in unreadable_behaviour(_Corrupt(folder, os.path.join(d, "corrupt.JPEG")), pre.to_uint8):
        print("  " + line)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
