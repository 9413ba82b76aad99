"""The paper's Table 2: ImageNet -> ImageNet-R, ImageNet-A and VisDA-2021.

    python experiments/imagenet_rav.py --checkpoint ckpt/vit_b16 --imagenet-r /data/imagenet-r \
        --imagenet-a /data/imagenet-a --visda /data/visda2021 --output runs/table2

ImageNet-R / -A: class folders of their 200 wnids; the logits are restricted to those 200
classes. VisDA-2021: its official validation list (`data.sources.visda_source`; label 1000 = no ImageNet
class), Resize((256, 256)) + CenterCrop(224), all 1000 logits; results give the accuracy over all samples
(the papers') and over known-class samples (the official metric).
Each dataset is one stream (``normal`` setting: shuffled, batch 64, reset to the source model).
"""

from __future__ import annotations

from typing import Sequence

from pcsr_jax.experiments import common
from pcsr_jax.errors import UserError

PRESETS = {"table2": dict(setting="normal", batch_size=64, seeds=(2022, 2023, 2024))}


def parser() -> common.ArgumentParser:
  p = common.parser("imagenet_rav.py", __doc__.split("\n\n")[0], PRESETS)
  p.add_argument("--imagenet-r", help="ImageNet-R root (<root>/<wnid>/*)")
  p.add_argument("--imagenet-a", help="ImageNet-A root (<root>/<wnid>/*)")
  p.add_argument("--visda", help="the folder VisDA-2021's validation zip was unpacked in (val_filelists/, "
                                 "val_data/); --image-list names another list")
  return p


def configs(a) -> dict:
  """``{dataset: RunConfig}`` of the flags: a run per dataset given."""
  runs = {name: dict(data=path, dataset=name) for name, path in
          (("imagenet_r", a.imagenet_r), ("imagenet_a", a.imagenet_a), ("visda", a.visda)) if path}
  if not runs:
    raise UserError("give at least one of --imagenet-r, --imagenet-a, --visda")
  return common.table_configs(a, PRESETS, "table2", runs, owned=("data", "dataset"))


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  common.start_devices(a)
  common.run_many(configs(a), a.output, "dataset")
  return 0
