"""Result records -> results.json, results.csv, the paper's Table 1 layout (table.md) and plots."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Sequence

import numpy as np

from pcsr_jax.data.imagenet import SHORT_NAMES

FIELDS = ("method", "setting", "corruption", "severity", "seed", "eval_order", "accuracy", "num_samples",
          "num_skipped", "seconds", "resets")


def write_json(path: str, records: Sequence[dict], config: dict, extra: dict | None = None,
               complete: bool = True) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(dict(complete=complete, config=config, records=list(records), **(extra or {})), f, indent=1)
  os.replace(tmp, path)


def write_csv(path: str, records: Sequence[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in records:
      w.writerow(r)


def table(records: Sequence[dict], corruptions: Sequence[str], methods: Sequence[str]) -> str:
  """Markdown in the layout of the paper's Table 1: methods as rows, corruptions + Avg as columns,
  accuracy (%) as mean ± std over seeds (population std)."""
  cols = list(corruptions)
  head = "| Method | " + " | ".join(SHORT_NAMES.get(c, c) for c in cols) + " | Avg. |"
  lines = [head, "|" + "---|" * (len(cols) + 2)]
  for m in methods:
    rs = [r for r in records if r["method"] == m]
    if not rs:
      continue
    seeds = sorted({r["seed"] for r in rs})
    per_seed = {s: {r["corruption"]: 100.0 * r["accuracy"] for r in rs if r["seed"] == s} for s in seeds}
    cells = []
    for c in cols:
      v = [per_seed[s][c] for s in seeds if c in per_seed[s]]
      cells.append(fmt_mean_std(v))
    avgs = [np.mean([per_seed[s][c] for c in cols]) for s in seeds if all(c in per_seed[s] for c in cols)]
    lines.append(f"| {m} | " + " | ".join(cells) + f" | {fmt_mean_std(avgs)} |")
  return "\n".join(lines) + "\n"


def fmt_mean_std(v: Sequence[float]) -> str:
  """Accuracies in [0, 100] -> "m" or "m ± s" (population std); "-" when empty."""
  if not v:
    return "-"
  return f"{np.mean(v):.1f}" if len(v) == 1 else f"{np.mean(v):.1f} ± {np.std(v):.1f}"


def plot(out_dir: str, records: Sequence[dict], curves: dict[str, Any], corruptions: Sequence[str],
         methods: Sequence[str]) -> list[str]:
  """Per-corruption accuracy bars per method, and running accuracy along the stream."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def save(fig, ax, ylabel: str, fontsize: int, name: str) -> str:
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 100)
    ax.legend(fontsize=fontsize)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(corruptions) * max(1, len(methods)) / 2), 4))
  width = 0.8 / max(1, len(methods))
  x = np.arange(len(corruptions))
  for i, m in enumerate(methods):
    acc = [np.mean([100 * r["accuracy"] for r in records if r["method"] == m and r["corruption"] == c] or [np.nan])
           for c in corruptions]
    ax.bar(x + i * width, acc, width, label=m)
  ax.set_xticks(x + width * (len(methods) - 1) / 2)
  ax.set_xticklabels([SHORT_NAMES.get(c, c) for c in corruptions], rotation=45, ha="right")
  paths = [save(fig, ax, "accuracy (%)", 8, "accuracy_per_corruption.png")]

  fig, ax = plt.subplots(figsize=(7, 4))
  for key, c in curves.items():
    if c["seen"]:
      ax.plot(c["seen"], 100 * np.asarray(c["accuracy"]), label=key)
  ax.set_xlabel("images seen")
  paths.append(save(fig, ax, "running accuracy (%)", 7, "running_accuracy.png"))
  return paths
