"""DDA's JPEG round trip on the device against PIL's: the pixel distance, and DDA's accuracy on the built-in
benchmark with each.

    python -m benchmarks.dda_jpeg                          # the distance on the built-in benchmark's images
    python -m benchmarks.dda_jpeg --accuracy --corruptions gaussian_noise,fog,contrast   # + DDA with each codec

The images are what DDA's round trip sees: the built-in benchmark's corrupted Fashion-MNIST-C images at the
UNet's 32 px (`--images` per corruption, the 15 benchmark corruptions), and uniform noise (the JPEG's worst
case) at 32 and 256 px (ImageNet's UNet), each saved at ``--quality`` (DDA's 75) by PIL and by
`corrupt_device.jpeg`. Prints the mean and largest absolute difference in 8-bit levels and the share of pixel
values that differ; with ``--accuracy`` the main job runs DDA on the built-in benchmark twice (``jpeg`` 'pil'
and 'device', everything else the same) and prints both tables' averages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def distance(images: np.ndarray, quality: int) -> dict:
  """PIL's and the device's round trip of uint8 NHWC ``images``: mean and max |difference|, share differing."""
  import jax.numpy as jnp

  from pcsr_jax.methods import dda

  pil = dda.jpeg_round_trip_host(images, quality).astype(np.int16)
  dev = np.asarray(dda.jpeg_round_trip(jnp.asarray(images), quality, "device")).astype(np.int16)
  d = np.abs(pil - dev)
  return dict(images=len(images), mean=float(d.mean()), max=int(d.max()), differ=float((d > 0).mean()))


def _dda_average(out: str, codec: str, corruptions: str, images: int) -> float:
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), "--methods", "dda", "--images",
         str(images), "--corruptions", corruptions, "--method-args", json.dumps({"dda": {"jpeg": codec}}),
         "--no-progress", "--output", out]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode:
    raise SystemExit(f"dda_jpeg: the {codec} run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
  with open(os.path.join(out, "results.json")) as f:
    recs = json.load(f)["records"]
  return 100 * float(np.mean([r["accuracy"] for r in recs]))


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="dda_jpeg.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=64, help="per corruption")
  p.add_argument("--quality", type=int, default=75)
  p.add_argument("--accuracy", action="store_true", help="also run DDA on the built-in benchmark with each codec")
  p.add_argument("--corruptions", default="gaussian_noise,fog,contrast", help="for --accuracy")
  a = p.parse_args(argv)
  if a.images < 1 or not 1 <= a.quality <= 100:
    p.error(f"--images must be positive and --quality in 1..100, got {a.images}, {a.quality}")
  from pcsr_jax.data.generators import corruptions as corr, fmnist_c
  from pcsr_jax.experiments import builtin

  srcs = fmnist_c.sources(list(corr.BENCHMARK), builtin.SEVERITY, a.images, progress=False, log=lambda *x: None)
  stream = np.concatenate([np.stack([s.load(i) for i in range(len(s))]) for _, s in srcs])
  rng = np.random.default_rng(0)
  noise = rng.integers(0, 256, (256, 32, 32, 3), dtype=np.uint8)
  noise256 = rng.integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)  # ImageNet's UNet size
  print(f"| images (quality {a.quality}) | n | mean abs diff | max abs diff | values differing |")
  print("|---|---|---|---|---|")
  for name, x in (("built-in benchmark, 15 corruptions, 32 px", stream), ("uniform noise, 32 px", noise),
                  ("uniform noise, 256 px", noise256)):
    d = distance(x, a.quality)
    print(f"| {name} | {d['images']:,} | {d['mean']:.4f} | {d['max']} | {100 * d['differ']:.2f}% |", flush=True)
  if a.accuracy:
    with tempfile.TemporaryDirectory(prefix="dda_jpeg_") as work:
      accs = {c: _dda_average(os.path.join(work, c), c, a.corruptions, a.images) for c in ("pil", "device")}
    print(f"DDA on {a.corruptions} ({a.images} images each): PIL {accs['pil']:.2f}%, device "
          f"{accs['device']:.2f}% (difference {accs['device'] - accs['pil']:+.2f} points)")
  return 0


if __name__ == "__main__":
  sys.exit(run_cli(main))
