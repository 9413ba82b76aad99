"""The paper's label-shift (L.S.) and mixed-shift (M.S.) table on ImageNet-C, severity 5.

    python experiments/wild.py --data /data/imagenet-c --checkpoint ckpt/vit_b16 --output runs/wild

L.S.: per corruption, SAR's class-phase stream (imbalance ratio 500000 unless
``--imbalance-ratio``; or SAR's published index files with ``--label-shift-indices``).
M.S.: all 15 corruptions shuffled into one stream, one model.
"""

from __future__ import annotations

from typing import Sequence

from pcsr_jax.experiments import common

PRESETS = {"wild": dict(severity=5, batch_size=64, seeds=(2022, 2023, 2024))}


def parser() -> common.ArgumentParser:
  return common.parser("wild.py", __doc__.split("\n\n")[0], PRESETS)


def configs(a) -> dict:
  """``{setting: RunConfig}`` of the flags: the label-shift and the mixed-shift run."""
  return common.table_configs(a, PRESETS, "wild", {"label_shifts": dict(setting="label_shifts"),
                                                   "mix_shifts": dict(setting="mix_shifts")}, owned=("setting",))


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  common.start_devices(a)
  common.run_many(configs(a), a.output, "setting")
  return 0
