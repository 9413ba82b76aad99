"""The CPU step table of docs/performance.md in one command: each (column, method) cell one `step_throughput` run.

    python -m benchmarks.cpu_table --out runs/cpu_table
    python -m benchmarks.cpu_table --out runs/cpu_table --columns vit_b16_b64 --methods tent,sar

Each cell runs ``python -m benchmarks.step_throughput`` in its own process, JAX against the PyTorch reference,
under the defaults of a CPU-only host (mimalloc, one JAX device per core) with the cell's timing settings
(`cell_flags`). Its printed output is appended to ``OUT/raw.md`` after the command that made it, and its figures
are written to ``OUT/<column>/<method>.json``. A cell whose JSON exists is not run again, so an interrupted table
resumes where it stopped (``--render`` only prints the table of the cells done). The table's cells are the
median of a cell's paired ratios (JAX / PyTorch images/s of two slices or rounds taken back to back), which a
slow spell of a shared machine moves less than either framework's own figure.

Timing settings. Interleaved slices (``--interleave``: both workers alive, taking turns seconds apart) wherever
both processes' peak memory fits this project's 24 GiB machine; else rounds of fresh workers one at a time
(``--rounds 2``): ViT-B/16 at batch 64 for SPA, AdaContrast, PCSR, pcsr-frozen and CoTTA (each framework peaks
at 12-19 GiB there) and MEMO at ViT-B/16 (JAX 18.6 GiB). Steps per slice fall as a step grows: a few seconds'
step gets 3 per slice after 2 warm-up, a minute's step 1. Batch 64 runs in passes of 16 rows (``--row-chunk
16``, the faster setting on a CPU); MEMO adapts on each image's own 64 views, so its cell is timed at batch 4
(ViT-S/16) or 2 (ViT-B/16) in the batch-16 columns and not at all in the batch-64 ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import NamedTuple, Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments.common import parse_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Column(NamedTuple):
  title: str
  arch: str
  batch_size: int


COLUMNS = {
    "vit_s16_b16": Column("ViT-S/16, batch 16", "vit_small_patch16_224", 16),
    "vit_b16_b16": Column("ViT-B/16, batch 16", "vit_base_patch16_224", 16),
    "vit_s16_b64": Column("ViT-S/16, batch 64", "vit_small_patch16_224", 64),
    "vit_b16_b64": Column("ViT-B/16, batch 64", "vit_base_patch16_224", 64),
}

# Rows in the table's order, each method's step cost class: how many steps a slice can afford.
METHODS = ("source", "t3a", "tent", "eta", "eata", "deyo", "cfa", "sar", "pcsr", "pcsr-frozen", "roid", "cmf",
           "spa", "adacontrast", "dept-g", "foa", "cotta", "dda", "memo", "vct", "dct", "dpal", "zerosiam", "rem",
           "dpcore", "tent-come", "eata-come", "sar-come")
FAST = ("source", "t3a", "eta", "eata", "deyo")  # one forward (ETA, EATA, DeYO filter random images out)
SLOW = ("spa", "adacontrast", "dept-g", "vct", "rem", "dpcore")  # 3 to 5 forwards and a backward or two
# DPCore's warm-up step takes its new-domain branch (50 steps of the known one's); the timed steps the known
# branch (2F+1B), on both sides (`method_args.DPCORE`).
HEAVY = ("foa", "cotta", "dda", "memo")  # tens of forwards (FOA, CoTTA), a diffusion (DDA), 64 views (MEMO)
# (column, method) cells whose two workers do not fit in 24 GiB together: rounds, one worker at a time.
ONE_AT_A_TIME = {("vit_b16_b64", m) for m in ("spa", "adacontrast", "pcsr", "pcsr-frozen", "cotta")} | {
    ("vit_b16_b16", "memo")}


def cell_flags(column: str, method: str) -> list[str] | None:
  """`step_throughput`'s flags for one cell, or None where the cell is not measured (MEMO at batch 64)."""
  col = COLUMNS[column]
  big = col.arch == "vit_base_patch16_224" or col.batch_size == 64  # a step about 4x ViT-S/16 batch 16's
  flags = ["--arch", col.arch, "--method", method]
  if method == "memo":
    if col.batch_size == 64:
      return None
    flags += ["--batch-size", "4" if col.arch == "vit_small_patch16_224" else "2", "--row-chunk", "16"]
  else:
    flags += ["--batch-size", str(col.batch_size)]
    if col.batch_size == 64:
      flags += ["--row-chunk", "16"]
  if method in HEAVY:
    steps, warmup, slices = 1, 0, 3
  elif method in SLOW:
    steps, warmup, slices = (1, 1, 3) if big else (2, 1, 4)
  elif column == "vit_b16_b64":
    steps, warmup, slices = (2, 1, 4) if method in FAST else (1, 1, 3)
  else:
    steps, warmup, slices = (3, 2, 4) if method in FAST or not big else (2, 1, 4)
  flags += ["--steps", str(steps), "--warmup", str(warmup)]
  flags += ["--rounds", "2"] if (column, method) in ONE_AT_A_TIME else ["--interleave", str(slices)]
  return flags


def cell_path(out: str, column: str, method: str) -> str:
  """Where a finished cell's figures are: ``out``/<column>/<method>.json."""
  return os.path.join(out, column, f"{method}.json")


def cell_ratio(result: dict) -> float:
  """A cell's figure: the median of its paired ratios (JAX / PyTorch)."""
  return result["paired_ratio_median"]


def render(out: str, columns: Sequence[str], methods: Sequence[str]) -> str:
  """The markdown table of the cells measured so far under ``out``: a ratio, "-" where not measured (MEMO at
  batch 64), "?" where not yet run."""
  from pcsr_jax import methods as registry

  lines = ["| method | per batch | " + " | ".join(COLUMNS[c].title for c in columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for m in methods:
    cells = []
    for c in columns:
      path = cell_path(out, c, m)
      if cell_flags(c, m) is None:
        cells.append("-")
      elif os.path.exists(path):
        with open(path) as f:
          cells.append(f"{cell_ratio(json.load(f)['results']):.2f}")
      else:
        cells.append("?")
    lines.append(f"| {m} | {registry.get(m).cost} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run_cell(out: str, column: str, method: str, flags: list[str]) -> bool:
  """One cell: `step_throughput` with ``flags``, its output shown and appended to ``out``/raw.md, its JSON
  written last (so that a cell cut short leaves none and runs again). True if it succeeded."""
  os.makedirs(os.path.join(out, column), exist_ok=True)
  path = cell_path(out, column, method)
  cmd = [sys.executable, "-m", "benchmarks.step_throughput", *flags]
  shown = "python -m benchmarks.step_throughput " + " ".join(flags)
  with open(os.path.join(out, "raw.md"), "a") as raw:
    raw.write(f"\n{column}, {method}: `{shown}`\n\n```\n")
    raw.flush()
    proc = subprocess.Popen([*cmd, "--json", path + ".part"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
      sys.stdout.write(line)
      sys.stdout.flush()
      raw.write(line)
      raw.flush()
    rc = proc.wait()
    raw.write("```\n" if rc == 0 else f"```\n(exit {rc})\n")
  if rc != 0 or not os.path.exists(path + ".part"):
    return False
  os.replace(path + ".part", path)
  return True


def _names(text: str | None, known: Sequence[str], flag: str) -> list[str]:
  if text is None:
    return list(known)
  names = parse_list(text)
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise UserError(f"{flag} {text!r}: expected a comma-separated list of {', '.join(known)}")
  return [n for n in known if n in names]


def parser() -> ArgumentParser:
  p = ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="folder of the cells' JSON and raw.md (an existing one resumes)")
  p.add_argument("--columns", help=f"comma-separated, of {', '.join(COLUMNS)} (default: all)")
  p.add_argument("--methods", help="comma-separated methods (default: every row)")
  p.add_argument("--render", action="store_true", help="only print the table of the cells done")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  columns = _names(a.columns, tuple(COLUMNS), "--columns")
  methods = _names(a.methods, METHODS, "--methods")
  failed = []
  if not a.render:
    for c in columns:
      for m in methods:
        flags = cell_flags(c, m)
        if flags is None or os.path.exists(cell_path(a.out, c, m)):
          continue
        if not run_cell(a.out, c, m, flags):
          failed.append(f"{c}/{m}")
  print(render(a.out, columns, methods), end="")
  if failed:
    raise UserError(f"{a.out}: cells that failed (their output is in raw.md; run again to retry): "
                    f"{', '.join(failed)}")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
