"""The paper's Table 2: ImageNet -> ImageNet-R, ImageNet-A and VisDA-2021.

    python experiments/imagenet_rav.py --checkpoint ckpt/vit_b16 --imagenet-r /data/imagenet-r \
        --imagenet-a /data/imagenet-a --visda /data/visda2021 --output runs/table2

ImageNet-R / -A: class folders of their 200 wnids; the logits are restricted to those 200
classes. VisDA-2021: an image list (``--image-list``, lines ``path label``, ImageNet-1k labels).
Each dataset is one stream (``normal`` setting: shuffled, batch 64, reset to the source model).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from pcsr_jax.errors import UserError, run_cli  # noqa: E402

PRESETS = {"table2": dict(setting="normal", batch_size=64, seeds=(2022, 2023, 2024))}


def main(argv: Sequence[str] | None = None) -> int:
  p = common.parser("imagenet_rav.py", __doc__.split("\n\n")[0], PRESETS)
  p.add_argument("--imagenet-r", help="ImageNet-R root (<root>/<wnid>/*)")
  p.add_argument("--imagenet-a", help="ImageNet-A root (<root>/<wnid>/*)")
  p.add_argument("--visda", help="VisDA-2021 root holding the image list")
  a = p.parse_args(argv)
  runs = {name: dict(data=path, dataset=name) for name, path in
          (("imagenet_r", a.imagenet_r), ("imagenet_a", a.imagenet_a), ("visda", a.visda)) if path}
  if not runs:
    raise UserError("give at least one of --imagenet-r, --imagenet-a, --visda")
  a.data = a.data or next(iter(runs.values()))["data"]
  a.preset = a.preset or "table2"
  base = common.config_from_args(a, PRESETS)
  if not a.output:
    base.output = os.path.join("runs", "table2")
  common.run_many(base, runs, "dataset")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
