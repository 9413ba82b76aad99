"""End-to-end harness check and timing on a generated ImageNet-C-layout folder.

    python -m benchmarks.end_to_end [--arch vit_tiny_patch16_224] [--images-per-class 8]

Generates ``<tmp>/<corruption>/5/<wnid>/*.JPEG`` (224 px noise JPEGs, 2 corruptions
x 4 classes), converts a randomized timm model of ``--arch`` through the
``convert_weights`` pipeline (or, without torch, saves a random Flax init with
the same shapes), then runs ``experiments/imagenet_c.py``'s harness for all four
methods in all five settings. Prints the decode throughput and the end-to-end
images/s per method and setting (first-step compile included, as a user sees it).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Sequence


from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser


def make_checkpoint(arch: str, path: str) -> str:
  try:
    from safetensors.torch import save_file

    from pcsr_jax import timm_parity, weights
    from pcsr_jax.models import get_config
  except ImportError:
    from tests import harness_fixtures
    from pcsr_jax.models import get_config

    print("torch/timm not installed: using a random Flax init with timm's shapes")
    return harness_fixtures.make_checkpoint(path, get_config(arch))
  model = timm_parity.timm_model(get_config(arch))
  timm_parity.randomize_(model)
  src = path + ".safetensors"
  save_file(model.state_dict(), src)
  return weights.convert_checkpoint(src, path)["out"]


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="end_to_end.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_tiny_patch16_224")
  p.add_argument("--images-per-class", type=int, default=8)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--settings", default="normal,continual,mix_shifts,label_shifts,bs1")
  a = p.parse_args(argv)
  from tests import harness_fixtures
  from pcsr_jax import harness

  with tempfile.TemporaryDirectory() as d:
    corr = ("gaussian_noise", "fog")
    harness_fixtures.make_imagenet_c(os.path.join(d, "data"), corruptions=corr, classes=4,
                                     per_class=a.images_per_class, size=224)
    ckpt = make_checkpoint(a.arch, os.path.join(d, "ckpt"))
    rows = []
    for setting in a.settings.split(","):
      cfg = harness.RunConfig(data=os.path.join(d, "data"), checkpoint=ckpt, output=os.path.join(d, setting),
                              corruptions=corr, seeds=(2022,), setting=setting, batch_size=a.batch_size,
                              limit=4 * a.images_per_class, progress=False)
      t0 = time.perf_counter()
      res = harness.run(cfg, log=lambda *x: None)
      wall = time.perf_counter() - t0
      for key, t in res["throughput"].items():
        rows.append((setting, key.split("/")[0], t["images"], t["images_per_s"]))
      print(f"{setting}: {len(res['records'])} records in {wall:.1f} s; decode {res['decode_images_per_s']:.0f} img/s")
  print(f"\nend-to-end images/s ({a.arch}, batch {a.batch_size}, 224 px JPEGs, compile included):")
  print("| setting | method | images | img/s |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} |")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
