"""One table from several finished runs of the same stream: each run's methods as rows, mean ± std over seeds.

    python experiments/merge_results.py runs/long/A runs/long/B --output table.md

A long benchmark is easier to run as several runs (different methods, each resumable, on different hosts or
cores) than as one. This reads each run's ``results.json``, checks that they measured the same stream (the
settings in `SAME`), and writes the Table 1 layout of `results.table` with one more column: each method's
images/s, the median over its (method, seed) units of the images it adapted on over the seconds they took.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from pcsr_jax import results
from pcsr_jax.errors import ArgumentParser, UserError

# What every merged run must share: the stream and the protocol. Not the methods, their arguments, the output or
# the loader: they may differ between runs.
SAME = ("data", "dataset", "corruptions", "severity", "seeds", "setting", "batch_size", "limit", "shuffle",
        "images_per_corruption", "corruption_seed", "dtype", "eval_order", "imbalance_ratio")


def load(run: str) -> dict:
  """A finished run's ``results.json`` (``run`` is its folder or the file); a `UserError` naming it otherwise."""
  path = os.path.join(run, "results.json") if os.path.isdir(run) else run
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path}: not found; expected a finished run's folder or its results.json") from None
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: not a readable results.json ({e})") from None
  if not isinstance(out, dict) or not all(isinstance(out.get(k), t) for k, t in (("config", dict), ("records", list),
                                                                                   ("throughput", dict))):
    raise UserError(f"{path}: expected a run's results.json with 'config', 'records' and 'throughput'")
  if not out.get("complete", False):
    raise UserError(f"{path}: the run is not complete; finish it with --resume first")
  out["path"] = path
  return out


def images_per_s(run: dict, method: str) -> float:
  """Median over the method's (method, seed) units of images/s (the harness's ``throughput``, one per unit)."""
  return float(np.median([u["images_per_s"] for k, u in run["throughput"].items() if k.split("/", 1)[0] == method]))


def merge(runs: Sequence[dict]) -> str:
  """The merged table (markdown): `results.table` over every run's records, plus an img/s column."""
  first = runs[0]
  for run in runs[1:]:
    for key in SAME:
      if run["config"].get(key) != first["config"].get(key):
        raise UserError(f"{run['path']}: {key} is {run['config'].get(key)!r}, but {first['path']} has "
                        f"{first['config'].get(key)!r}; merge only runs of the same stream")
  owner: dict[str, dict] = {}
  for run in runs:
    for m in run["config"]["methods"]:
      if m in owner:
        raise UserError(f"{run['path']}: method {m} is also in {owner[m]['path']}; each method from one run")
      owner[m] = run
  records = [r for run in runs for r in run["records"]]
  ips = {m: f"{images_per_s(run, m):.0f}" for m, run in owner.items()}
  return results.table(records, first["config"]["corruptions"], list(owner), extra=("img/s", ips))


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="merge_results.py", description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="finished runs' output folders (or their results.json)")
  p.add_argument("--output", help="also write the table to this markdown file")
  a = p.parse_args(argv)
  table = merge([load(r) for r in a.runs])
  print(table, end="")
  if a.output:
    with open(a.output, "w", encoding="utf-8") as f:
      f.write(table)
  return 0
