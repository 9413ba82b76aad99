"""One table from several finished runs of the same stream: each run's methods as rows, mean ± std over seeds.

    python experiments/merge_results.py runs/long/A runs/long/B --output table.md

A long benchmark is easier to run as several runs (different methods or seeds, each resumable, on different
hosts or cores) than as one. This reads each run's ``results.json``, checks that they measured the same stream
(the settings in `SAME`), takes each (method, seed) unit from the one run that has it, and writes the Table 1
layout of `results.table` with one more column: each method's images/s, the median over its units of the images
it adapted on over the seconds they took, followed by its seeds where a method has fewer than another.
After it comes the merged cost table (`cost.table`): each method's step time, img/s, compile time and memory as
the run it comes from measured them, each row naming its devices and its run (``--speed``: that run's). A run
from before costs were recorded gives no row. ``--partial`` also takes the finished units of a run still under
way (its ``resume/``), so that a run whose slowest methods are left to finish elsewhere still gives its finished
ones; it says which units are missing and which of them are under way (with saved progress).

A long run split over processes that share a machine (or were paused) times each unit against its neighbours,
so its img/s say little about a method's speed. ``--speed RUN`` takes the img/s column from another finished
run instead (the same dataset, setting, batch size and dtype; any number of images), e.g. a short run of every
method with the machine to itself.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Sequence

import numpy as np

from pcsr_jax import cost, results
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.files import atomic_path

# What every merged run must share: the stream and the protocol. Not the methods, their arguments, the seeds, the
# output or the loader: they may differ between runs (a (method, seed) unit is taken from one run only).
SAME = ("data", "dataset", "corruptions", "severity", "setting", "batch_size", "limit", "shuffle",
        "images_per_corruption", "corruption_seed", "dtype", "eval_order", "imbalance_ratio")
# What a --speed run must share with the merged runs for its img/s to be theirs: not the stream's length.
SAME_SPEED = ("data", "dataset", "setting", "batch_size", "dtype")


def load_progress(run: str) -> dict:
  """The finished (method, seed)s of a run still under way, from its ``resume/`` (what ``--resume`` reads: the
  manifest and each unit's record), in `load`'s form: their records and images/s only, a (method, seed) whose
  units are not all finished left out. ``missing`` lists the units not finished, ``under_way`` those with saved
  progress (the batch they saved at)."""
  from pcsr_jax import progress

  resume = progress.Resume(run)
  try:
    with open(resume.path, encoding="utf-8") as f:
      manifest = json.load(f)
    config = json.loads(manifest["config_key"])
    keys = list(manifest["units"])
  except FileNotFoundError:
    raise UserError(f"{run}: neither results.json nor resume/progress.json; expected a run's output folder") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"{resume.path}: not a readable progress file ({type(e).__name__}: {e})") from None
  recs = {k: resume.load_unit(k) for k in keys}
  missing = [k for k in keys if recs[k] is None or not recs[k].done]
  open_stems = {progress.stem(k) for k in missing}
  merged = progress.merge([r for k, r in recs.items() if k not in missing and progress.stem(k) not in open_stems])
  under_way = {k: recs[k].progress.seen for k in missing if recs[k] is not None and recs[k].progress is not None}
  return dict(config=config, records=merged.records, throughput=merged.throughput, complete=False, path=resume.path,
              missing=missing, under_way=under_way, costs=cost.load(resume.dir))


def report_missing(run: dict) -> str:
  """One line on a run under way's units not finished: how many, which are under way and how far, which not
  started."""
  if not run.get("missing"):
    return ""
  going = ", ".join(f"{k} ({seen:,} images in)" for k, seen in run["under_way"].items())
  fresh = [k for k in run["missing"] if k not in run["under_way"]]
  return (f"{run['path']}: {len(run['missing'])} unit(s) not finished, left out with their method and seed"
          + (f"; under way: {going}" if going else "") + (f"; not started: {', '.join(fresh)}" if fresh else ""))


def load(run: str, partial: bool = False) -> dict:
  """A finished run's ``results.json`` (``run`` is its folder or the file); with ``partial``, a folder without
  one gives its finished units (`load_progress`); a `UserError` naming it otherwise."""
  path = os.path.join(run, "results.json") if os.path.isdir(run) else run
  if partial and os.path.isdir(run) and not os.path.exists(path):
    return load_progress(run)
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
    raise UserError(f"{path}: the run is not complete; finish it with --resume first (or --partial, for its "
                    "finished units)")
  out["path"] = path
  return out


def _first_difference(run: dict, other: dict, keys: Sequence[str]) -> str | None:
  """The first of ``keys`` whose config value differs between the two loaded runs, or None."""
  return next((k for k in keys if run["config"].get(k) != other["config"].get(k)), None)


def _images_per_s(runs: Sequence[dict], method: str) -> list[float]:
  return [u["images_per_s"] for run in runs for k, u in run["throughput"].items() if k.split("/", 1)[0] == method]


def img_per_s_cell(value: float) -> str:
  """A rate to at least two significant digits: whole numbers from 10 img/s up, decimals below (MEMO's and
  DDA's 6.7 and 1.3 img/s would otherwise read 7 and 1)."""
  if value <= 0:
    return "0"
  return f"{value:.{max(0, 1 - math.floor(math.log10(value)))}f}"


def merge(runs: Sequence[dict], speed: dict | None = None) -> str:
  """The merged table (markdown): `results.table` over every run's records, plus an img/s column (from
  ``speed``, a `load`ed run, when given)."""
  first = runs[0]
  for run in runs[1:]:
    if (key := _first_difference(run, first, SAME)) is not None:
      raise UserError(f"{run['path']}: {key} is {run['config'].get(key)!r}, but {first['path']} has "
                      f"{first['config'].get(key)!r}; merge only runs of the same stream")
  owner: dict[tuple[str, int], str] = {}
  for run in runs:
    for unit in sorted({(r["method"], r["seed"]) for r in run["records"]}):
      if unit in owner:
        raise UserError(f"{run['path']}: {unit[0]} seed {unit[1]} is also in {owner[unit]}; each unit from one run")
      owner[unit] = run["path"]
  methods = merged_methods(runs)
  if not methods:
    raise UserError(f"{', '.join(run['path'] for run in runs)}: no finished unit to merge")
  records = [r for run in runs for r in run["records"]]
  seeds = {m: sorted(s for mm, s in owner if mm == m) for m in methods}
  most = max(len(s) for s in seeds.values())
  if speed is not None:
    if (key := _first_difference(speed, first, SAME_SPEED)) is not None:
      raise UserError(f"--speed {speed['path']}: {key} is {speed['config'].get(key)!r}, but {first['path']} has "
                      f"{first['config'].get(key)!r}; expected a run of the same dataset, setting, batch size and "
                      "dtype")
    missing = [m for m in methods if not _images_per_s([speed], m)]
    if missing:
      raise UserError(f"--speed {speed['path']}: no img/s for {', '.join(missing)}; expected a run of every "
                      "merged method")
  cells = {}
  for m in methods:
    ips = _images_per_s([speed] if speed is not None else runs, m)
    named = f"seed{'s' if len(seeds[m]) > 1 else ''} {', '.join(map(str, seeds[m]))}"
    fewer = "" if len(seeds[m]) == most else f" ({named})"
    cells[m] = f"{img_per_s_cell(float(np.median(ips)))}{fewer}"
  return results.table(records, first["config"]["corruptions"], methods, extra=("img/s", cells))


def merge_costs(runs: Sequence[dict], speed: dict | None = None) -> str:
  """The cost table of the merged methods (`cost.table`): each method's costs from ``speed`` when given, else from
  the first run that has both its units and its costs; "" when no run recorded any."""
  costs, origin = {}, {}
  for m in merged_methods(runs):
    for run in [speed] if speed is not None else runs:
      c = run.get("costs")
      if isinstance(c, dict) and isinstance(c.get(m), dict) and (speed is not None or _has_units(run, m)):
        costs[m], origin[m] = c[m], run["path"]
        break
  return cost.table(costs, list(costs), origin=origin) if costs else ""


def merged_methods(runs: Sequence[dict]) -> list[str]:
  """The merged table's methods in order: each run's methods, in its config's order, that have units in it or
  in a run before it."""
  have: set[str] = set()
  methods: list[str] = []
  for run in runs:
    have |= {r["method"] for r in run["records"]}
    methods += [m for m in run["config"]["methods"] if m not in methods and m in have]
  return methods


def _has_units(run: dict, method: str) -> bool:
  return any(r["method"] == method for r in run["records"])


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="merge_results.py", description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="finished runs' output folders (or their results.json)")
  p.add_argument("--output", help="also write the table to this markdown file")
  p.add_argument("--partial", action="store_true", help="also take the finished units of runs still under way "
                 "(their resume/progress.json)")
  p.add_argument("--speed", help="take each method's img/s from this finished run (its folder or results.json) "
                 "instead: one with the machine to itself, of the same dataset, setting, batch size and dtype")
  a = p.parse_args(argv)
  if a.output is not None:
    check_output_file(a.output)
  runs = [load(r, a.partial) for r in a.runs]
  speed = load(a.speed) if a.speed else None
  table = merge(runs, speed=speed)
  costs = merge_costs(runs, speed)
  table += f"\n{costs}" if costs else ""
  for line in map(report_missing, runs):  # after the merge: a refused one is its one line alone
    if line:
      print(line, file=sys.stderr)
  print(table, end="")
  if a.output:
    with atomic_path(a.output) as tmp, open(tmp, "w", encoding="utf-8") as f:
      f.write(table)
  return 0


def check_output_file(path: str) -> None:
  """``--output``: a file that can be written (in a folder that exists and is writable, not a folder itself),
  checked before any run is read; else a one-line `UserError`."""
  folder = os.path.dirname(os.path.abspath(path))
  if not path or os.path.isdir(path):
    raise UserError(f"--output {path}: expected a markdown file's path, got {'a folder' if path else 'nothing'}")
  if not os.path.isdir(folder):
    raise UserError(f"--output {path}: {folder} is not a folder")
  if not os.access(folder, os.W_OK | os.X_OK):
    raise UserError(f"--output {path}: {folder} is not writable")
