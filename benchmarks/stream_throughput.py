"""Throughput of the corruption stream per corruption: the release-way folder, the host path, the device path.

    python -m benchmarks.stream_throughput [--clean-data DIR] [--images 64] [--severity 3] [--workers 2]
        [--corruptions all|heldout|bar|a,b,...]

For each corruption, images/s of decode + corrupt + preprocess (the harness's ImageNet-C preprocessing,
`transforms.imagenet_c_preprocess` at 224 px, uint8 out), one full pass through the harness's `Loader` (its
threads, batches of 64):

* ``folder``: the release's files read back (what ``--data`` does): the same images, written once beforehand
  the release's way (the host path's corrupted array, PIL JPEG quality 85), decoded;
* ``host``: ``--clean-data`` on the host (`generated.CorruptedSource`): decode the clean JPEG, Resize(256) +
  CenterCrop(224), the corruption in numpy, the JPEG round trip;
* ``device``: the clean 224 px crops decoded on the host (`generated.CleanCrops`), then the corruption and
  the JPEG round trip as one jitted JAX function on the default device (`corrupt_device.BatchCorrupter`, as
  ``--corrupt-on device`` runs them), for the corruptions it has.

``host / folder`` is what generating costs against reading the 60 GB release; ``device / host`` what the
device path gains. Without ``--clean-data`` the clean images are generated: ``--images`` JPEGs at 500x375 (the
commonest ImageNet val size), smooth colour fields with noise texture, in one ``<wnid>/`` folder; a real
ImageNet val folder gives the same figures up to JPEG decode time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Sequence

import numpy as np
from PIL import Image

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

BATCH = 64


def make_clean(root: str, n: int, seed: int = 0) -> str:
  """``n`` 500x375 JPEGs (quality 90, ImageNet's own) in ``root/n01440764/``; returns ``root``."""
  rng = np.random.default_rng(seed)
  d = os.path.join(root, "n01440764")
  os.makedirs(d, exist_ok=True)
  yy, xx = np.mgrid[0:375, 0:500] / 500.0
  for i in range(n):
    f = rng.uniform(2, 9, 3)
    base = np.stack([np.sin(f[0] * xx + i), np.cos(f[1] * yy), np.sin(f[2] * (xx + yy))], -1)
    img = np.clip(127 + 90 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(os.path.join(d, f"ILSVRC2012_val_{i:08d}.JPEG"), quality=90)
  return root


def timed_pass(srcs, fn, workers: int) -> tuple[float, np.ndarray]:
  """img/s of one pass of the harness's `Loader` over the first source, and the images."""
  from pcsr_jax.data.loader import Loader

  loader = Loader(srcs, fn, BATCH, workers=workers)
  n = len(srcs[0])
  ids, idx = np.zeros(n, np.int32), np.arange(n)
  t0 = time.perf_counter()
  images = np.concatenate([b.images for b in loader.batches(ids, idx)])
  return n / (time.perf_counter() - t0), images


def write_release_folder(src, root: str) -> None:
  """``src`` (a `generated.CorruptedSource`) written as the release's files: the corrupted uint8 array saved
  with PIL at quality 85 (`CorruptedSource.corrupted`, before the JPEG round trip)."""
  for i, name in enumerate(src.names):
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(src.corrupted(i)).save(path, quality=85, optimize=True)


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="python -m benchmarks.stream_throughput", description=__doc__.split("\n\n")[0])
  p.add_argument("--clean-data", help="a clean <dir>/<wnid>/*.JPEG folder (default: generated images)")
  p.add_argument("--images", type=int, default=64, help="clean images (the first N of --clean-data)")
  p.add_argument("--severity", type=float, default=3)
  p.add_argument("--corruptions", default="all", help="'all' (15), 'heldout' (4), or comma-separated names")
  p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  p.add_argument("--no-device", action="store_true", help="skip the device path")
  a = p.parse_args(argv)
  if a.images < 1:
    raise UserError(f"--images: expected a positive integer, got {a.images}")

  import jax

  from pcsr_jax.data import sources, transforms
  from pcsr_jax.data.generators import generated
  from pcsr_jax.experiments.common import parse_corruptions

  names = parse_corruptions(a.corruptions)
  pre = transforms.imagenet_c_preprocess(dict(img_size=224, mean=(0.5,) * 3, std=(0.5,) * 3, crop_pct=1.0))
  device = None
  if not a.no_device:
    from pcsr_jax.data.generators import corrupt_device as device
  with tempfile.TemporaryDirectory() as d:
    clean = sources.FolderSource(a.clean_data or make_clean(os.path.join(d, "clean"), a.images))
    if len(clean) > a.images:
      keep = np.arange(a.images)
      clean.paths = [clean.paths[i] for i in keep]
      clean.labels, clean.names = clean.labels[keep], [clean.names[i] for i in keep]
    print(f"{len(clean)} clean images ({a.clean_data or 'generated, 500x375'}); severity {a.severity:g}; "
          f"{a.workers} decode threads; {os.cpu_count()} CPU cores; device {jax.devices()[0].device_kind}; "
          f"batch {BATCH}", flush=True)
    crops = None
    print("| corruption | folder img/s | host img/s | host / folder | device img/s | device / host |\n"
          "|---|---|---|---|---|---|", flush=True)
    for c in names:
      src = generated.CorruptedSource(clean, c, a.severity, seed=0)
      folder = os.path.join(d, "release", c)
      write_release_folder(src, folder)
      folder_ips, from_folder = timed_pass([sources.FolderSource(folder)], pre.to_uint8, a.workers)
      host_ips, from_host = timed_pass([src], pre.to_uint8, a.workers)
      if not np.array_equal(from_folder, from_host):
        raise SystemExit(f"{c}: the host path differs from its own release-way folder (a bug)")
      cells = ["-", "-"]
      if device is not None and c in device.DEVICE_CORRUPTIONS:
        crop_src = generated.CleanCrops(clean, c, a.severity, seed=0)  # what --corrupt-on device decodes
        if crops is None:
          crop_ips, crops = timed_pass([crop_src], lambda x: x, a.workers)
        corrupter = device.BatchCorrupter(c, a.severity, 0, img_size=224)  # the harness's device step
        keys = crop_src.keys(clean.names)
        run = lambda: jax.block_until_ready(corrupter(jax.numpy.asarray(crops), keys))
        run()  # compile
        t0 = time.perf_counter()
        run()
        dev_s = time.perf_counter() - t0
        # Decoding the clean crops and the device function overlap in the harness: the slower one sets the pace.
        device_ips = min(crop_ips, len(clean) / dev_s)
        cells = [f"{device_ips:.0f}", f"{device_ips / host_ips:.2f}"]
      print(f"| {c} | {folder_ips:.0f} | {host_ips:.0f} | {host_ips / folder_ips:.2f} | {cells[0]} | {cells[1]} |",
            flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
