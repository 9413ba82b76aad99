"""Result records -> results.json, results.csv, the paper's Table 1 layout (table.md) and plots."""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Sequence

import numpy as np

from pcsr_jax import files
from pcsr_jax.data.imagenet import SHORT_NAMES

FIELDS = ("method", "setting", "corruption", "severity", "seed", "eval_order", "accuracy", "num_samples",
          "num_skipped", "seconds", "resets")


def write_json(path: str, records: Sequence[dict], config: dict, extra: dict | None = None,
               complete: bool = True) -> None:
  files.write_json(path, dict(complete=complete, config=config, records=list(records), **(extra or {})), indent=1)


def write_csv(path: str, records: Sequence[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in records:
      w.writerow(r)


def table(records: Sequence[dict], corruptions: Sequence[str], methods: Sequence[str],
          extra: tuple[str, Mapping[str, str]] | None = None) -> str:
  """Markdown in the layout of the paper's Table 1: methods as rows, corruptions + Avg as columns,
  accuracy (%) as mean ± std over seeds (population std). A corruption with several records per seed (the gradual
  setting's severities) counts their mean. ``extra``: one more column after Avg., ``(header, {method: cell})``."""
  cols = list(corruptions)
  head = "| Method | " + " | ".join(SHORT_NAMES.get(c, c) for c in cols) + " | Avg. |"
  head += f" {extra[0]} |" if extra else ""
  lines = [head, "|" + "---|" * (len(cols) + 2 + bool(extra))]
  for m in methods:
    rs = [r for r in records if r["method"] == m]
    if not rs:
      continue
    seeds = sorted({r["seed"] for r in rs})
    per_seed = {s: {c: float(np.mean(v)) for c, v in _by_corruption([r for r in rs if r["seed"] == s]).items()}
                for s in seeds}
    cells = []
    for c in cols:
      v = [per_seed[s][c] for s in seeds if c in per_seed[s]]
      cells.append(fmt_mean_std(v))
    avgs = [np.mean([per_seed[s][c] for c in cols]) for s in seeds if all(c in per_seed[s] for c in cols)]
    more = f" {extra[1][m]} |" if extra else ""
    lines.append(f"| {m} | " + " | ".join(cells) + f" | {fmt_mean_std(avgs)} |" + more)
  return "\n".join(lines) + "\n"


def _by_corruption(records: Sequence[dict]) -> dict[str, list[float]]:
  out: dict[str, list[float]] = {}
  for r in records:
    out.setdefault(r["corruption"], []).append(100.0 * r["accuracy"])
  return out


def fmt_mean_std(v: Sequence[float]) -> str:
  """Accuracies in [0, 100] -> "m" or "m ± s" (population std); "-" when empty."""
  if not v:
    return "-"
  return f"{np.mean(v):.1f}" if len(v) == 1 else f"{np.mean(v):.1f} ± {np.std(v):.1f}"


def _accuracy(records: Sequence[dict], method: str, corruptions: Sequence[str]) -> np.ndarray:
  """Per corruption, in %, mean over seeds (NaN where the method has no record)."""
  return np.asarray([np.mean([100 * r["accuracy"] for r in records if r["method"] == method and r["corruption"] == c]
                             or [np.nan]) for c in corruptions])


def _bars(ax, values: dict[str, np.ndarray], corruptions: Sequence[str]) -> None:
  width = 0.8 / max(1, len(values))
  x = np.arange(len(corruptions))
  for i, (m, v) in enumerate(values.items()):
    ax.bar(x + i * width, v, width, label=m)
  ax.set_xticks(x + width * (len(values) - 1) / 2)
  ax.set_xticklabels([SHORT_NAMES.get(c, c) for c in corruptions], rotation=45, ha="right")


def _running_gain(curves: dict[str, Any], method: str) -> tuple[list, np.ndarray] | None:
  """``(seen, gain)``: the method's running accuracy minus Source's on the same streams, mean over seeds."""
  seeds = sorted({k.split("/", 1)[1] for k in curves})
  pairs = [(curves[f"{method}/{sd}"], curves[f"source/{sd}"]) for sd in seeds
           if f"{method}/{sd}" in curves and f"source/{sd}" in curves]
  pairs = [(c, s) for c, s in pairs if c["seen"] and c["seen"] == s["seen"]]  # the same stream: same points
  if not pairs:
    return None
  return pairs[0][0]["seen"], np.mean([np.asarray(c["accuracy"]) - np.asarray(s["accuracy"]) for c, s in pairs], 0)


PLOTS = ("gain_over_source.png", "accuracy_per_corruption.png", "running_accuracy.png")  # what `plot` writes


def plot(out_dir: str, records: Sequence[dict], curves: dict[str, Any], corruptions: Sequence[str],
         methods: Sequence[str]) -> list[str]:
  """Each method's gain over Source (when Source ran), per-corruption accuracy bars, running accuracy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def save(fig, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=120)
    plt.close(fig)
    return os.path.join(out_dir, name)

  paths = []
  others = [m for m in methods if m != "source"]
  if "source" in methods and others:
    # What a reader wants first: how much each method gains over Source, per corruption and along the stream.
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(min(16, max(10, 0.2 * len(corruptions) * len(others) + 5)), 4.5),
                                   gridspec_kw=dict(width_ratios=[2, 1]))
    src = _accuracy(records, "source", corruptions)
    _bars(ax1, {m: _accuracy(records, m, corruptions) - src for m in others}, corruptions)
    ax1.set_ylabel("accuracy gain over Source (points)")
    for m in others:
      gain = _running_gain(curves, m)
      if gain is not None:
        ax2.plot(gain[0], 100 * gain[1], label=m)
    ax2.set_xlabel("images seen")
    ax2.set_ylabel("running accuracy gain over Source (points)")
    for ax, size in ((ax1, 8), (ax2, 7)):
      ax.axhline(0, color="k", lw=0.8)
      ax.legend(fontsize=size)
    paths.append(save(fig, PLOTS[0]))

  fig, ax = plt.subplots(figsize=(min(16, max(6, 0.2 * len(corruptions) * len(methods) + 3)), 4))
  _bars(ax, {m: _accuracy(records, m, corruptions) for m in methods}, corruptions)
  ax.set_ylabel("accuracy (%)")
  ax.set_ylim(0, 100)
  ax.legend(fontsize=8)
  paths.append(save(fig, PLOTS[1]))

  fig, ax = plt.subplots(figsize=(7, 4))
  for key, c in curves.items():
    if c["seen"]:
      ax.plot(c["seen"], 100 * np.asarray(c["accuracy"]), label=key)
  ax.set_xlabel("images seen")
  ax.set_ylabel("running accuracy (%)")
  ax.set_ylim(0, 100)
  ax.legend(fontsize=7)
  paths.append(save(fig, PLOTS[2]))
  return paths
