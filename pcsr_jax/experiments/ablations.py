"""The paper's ablations on ImageNet-C severity 5 (PCSR only): Tables 3-5 and the learning-rate sweep.

    python experiments/ablations.py --data /data/imagenet-c --checkpoint ckpt/vit_b16 \
        --table conditioning|aggregation|qkv|lr --output runs/ablations

* conditioning (Table 3): FGN conditioned on the class token, the mean token, the domain token, both.
* aggregation (Table 4): max, average or attention pooling of the DSN outputs.
* qkv (Table 5): Q, K, V factors independent or shared.
* lr: DSN lr in {0.02, 0.05, 0.1, 0.2, 0.5} at FGN 0.0005, and FGN lr in {0.0001, 0.0005, 0.001, 0.005}
  at DSN 0.2.
"""

from __future__ import annotations

from typing import Sequence

from pcsr_jax.experiments import common

PRESETS = {"ablation": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                            methods=("pcsr",))}


def variants(table: str) -> dict:
  cfg = lambda **c: dict(method_args={"pcsr": {"config": c}})
  lr = lambda dsn, fgn: dict(method_args={"pcsr": {"lr_dsn": dsn, "lr_fgn": fgn}})
  if table == "conditioning":
    return {f"condition={c}": cfg(condition=c) for c in ("class", "mean", "domain", "class+domain")}
  if table == "aggregation":
    return {f"aggregation={g}": cfg(aggregation=g) for g in ("max", "avg", "attention")}
  if table == "qkv":
    return {f"qkv={q}": cfg(qkv_factors=q) for q in ("independent", "shared")}
  runs = {f"lr_dsn={d}": lr(d, 0.0005) for d in (0.02, 0.05, 0.1, 0.2, 0.5)}
  runs.update({f"lr_fgn={f}": lr(0.2, f) for f in (0.0001, 0.001, 0.005)})
  return runs


def parser() -> common.ArgumentParser:
  p = common.parser("ablations.py", __doc__.split("\n\n")[0], PRESETS)
  p.add_argument("--table", required=True, choices=["conditioning", "aggregation", "qkv", "lr"])
  return p


def configs(a) -> dict:
  """``{variant: RunConfig}`` of the flags: PCSR under each variant of ``--table``."""
  return common.table_configs(a, PRESETS, "ablation", variants(a.table), output=f"ablation_{a.table}",
                              owned=("methods",))


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  common.start_devices(a)
  common.run_many(configs(a), a.output, a.table)
  return 0
