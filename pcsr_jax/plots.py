"""A finished run's plots (`figures`, saved by `plot`), drawn so that methods a point apart stay apart:

* ``gain_over_source.png`` (when Source ran beside other methods): each method's accuracy minus Source's, per
  domain (bars) and along the stream (its running accuracy minus Source's): the differences, not the levels;
* ``accuracy_per_corruption.png``: every method's accuracy per domain (bars);
* ``running_accuracy.png``: one small panel per method (a line per seed), never two methods on one panel:
  Source's running accuracy, then each method's minus Source's (on one y range), or, without Source, each
  method's running accuracy;
* ``accuracy_vs_cost.png`` (when the run measured its costs, `pcsr_jax.cost`): each method's average accuracy
  against its step's images/s (log scale) and against its memory, one labelled point per method, Source a star
  with a dashed line at its accuracy. The memory axis is the compiled step's (XLA's figure for that method), not
  the process's peak, which only grows from one method to the next.

Every legend sits outside the axes (beside or above the data, never on it), and a figure draws one only where it
has labelled lines (a run of one method has none: no matplotlib warning).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from pcsr_jax.data.imagenet import SHORT_NAMES

PLOTS = ("gain_over_source.png", "accuracy_per_corruption.png", "running_accuracy.png",
         "accuracy_vs_cost.png")  # what `plot` writes


def accuracy(records: Sequence[dict], method: str, domains: Sequence[str]) -> np.ndarray:
  """Per domain, in %, mean over seeds (NaN where the method has no record)."""
  return np.asarray([np.mean([100 * r["accuracy"] for r in records if r["method"] == method and r["corruption"] == c]
                             or [np.nan]) for c in domains])


def running_gain(curves: dict[str, Any], method: str) -> tuple[list, np.ndarray] | None:
  """``(seen, gain)``: the method's running accuracy minus Source's on the same streams, mean over seeds."""
  seeds = sorted({k.split("/", 1)[1] for k in curves})
  pairs = [(curves[f"{method}/{sd}"], curves[f"source/{sd}"]) for sd in seeds
           if f"{method}/{sd}" in curves and f"source/{sd}" in curves]
  pairs = [(c, s) for c, s in pairs if c["seen"] and c["seen"] == s["seen"]]  # the same stream: same points
  if not pairs:
    return None
  return pairs[0][0]["seen"], np.mean([np.asarray(c["accuracy"]) - np.asarray(s["accuracy"]) for c, s in pairs], 0)


def _bars(ax, values: dict[str, np.ndarray], domains: Sequence[str]) -> None:
  width = 0.8 / max(1, len(values))
  x = np.arange(len(domains))
  for i, (m, v) in enumerate(values.items()):
    ax.bar(x + i * width, v, width, label=m, color=_color(i))
  ax.set_xticks(x + width * (len(values) - 1) / 2)
  ax.set_xticklabels([SHORT_NAMES.get(c, c) for c in domains], rotation=45, ha="right")


def _color(i: int):
  """The i-th method's color: tab10, then tab20's lighter shades, so that up to 20 methods differ."""
  import matplotlib

  return matplotlib.colormaps["tab10" if i < 10 else "tab20"](i if i < 10 else 2 * (i - 10) % 20 + 1)


def _legend_right(fig, ax, ncol: int = 1) -> None:
  """The legend of ``ax``'s labelled artists beside it, outside the axes (none when nothing is labelled)."""
  handles, labels = ax.get_legend_handles_labels()
  if handles:
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
              ncol=ncol, frameon=False)


def figures(records: Sequence[dict], curves: dict[str, Any], domains: Sequence[str],
            methods: Sequence[str], costs: dict | None = None) -> dict[str, Any]:
  """``{file name: matplotlib Figure}`` of `PLOTS` (gain over Source only when Source ran beside others; accuracy
  against cost only with ``costs``)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = {}
  ncol = 1 if len(methods) <= 14 else 2
  others = [m for m in methods if m != "source"]
  if "source" in methods and others:
    width = min(18, max(10, 0.25 * len(domains) * len(others) + 6))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(width, 4.5), gridspec_kw=dict(width_ratios=[2, 1]),
                                   layout="constrained")
    src = accuracy(records, "source", domains)
    _bars(ax1, {m: accuracy(records, m, domains) - src for m in others}, domains)
    ax1.set_ylabel("accuracy minus Source's (points)")
    ax1.set_title("per domain")
    for i, m in enumerate(others):
      gain = running_gain(curves, m)
      if gain is not None:
        ax2.plot(gain[0], 100 * gain[1], color=_color(i), label=m)
    ax2.set_xlabel("images seen")
    ax2.set_ylabel("running accuracy minus Source's (points)")
    ax2.set_title("along the stream")
    for ax in (ax1, ax2):
      ax.axhline(0, color="k", lw=0.8)
    _legend_right(fig, ax2, ncol)
    out[PLOTS[0]] = fig

  fig, ax = plt.subplots(figsize=(min(18, max(7, 0.22 * len(domains) * len(methods) + 4)), 4),
                         layout="constrained")
  _bars(ax, {m: accuracy(records, m, domains) for m in methods}, domains)
  ax.set_ylabel("accuracy (%)")
  ax.set_ylim(0, 100)
  _legend_right(fig, ax, ncol)
  out[PLOTS[1]] = fig

  out[PLOTS[2]] = _running_panels(plt, curves, methods)
  if costs and any(m in costs for m in methods):
    out[PLOTS[3]] = _cost_panels(plt, records, domains, [m for m in methods if m in costs], costs)
  return out


def _cost_panels(plt, records: Sequence[dict], domains: Sequence[str], methods: Sequence[str], costs: dict):
  """Average accuracy against images/s (log x) and against the compiled step's memory (MiB), a labelled point
  per method; Source a black star and a dashed line at its accuracy."""
  acc = {m: float(np.nanmean(accuracy(records, m, domains))) for m in methods}
  mem = {m: costs[m].get("step_memory_bytes") or costs[m].get("peak_memory_bytes") for m in methods}
  per_step = all(costs[m].get("step_memory_bytes") for m in methods)
  fig, axes = plt.subplots(1, 2, figsize=(13 if len(methods) > 10 else 10, 5.2), layout="constrained")
  for ax, x, label, log in ((axes[0], {m: costs[m]["images_per_s"] for m in methods}, "images/s of the step "
                             "(log scale)", True),
                            (axes[1], {m: (mem[m] or 0) / 2 ** 20 for m in methods},
                             "memory of the compiled step (MiB, XLA)" if per_step else "peak memory (MiB)", False)):
    for i, m in enumerate(methods):
      src = m == "source"
      ax.scatter(x[m], acc[m], s=110 if src else 28, marker="*" if src else "o", zorder=3,
                 color="k" if src else _color(i), edgecolors="none")
    if "source" in acc:
      ax.axhline(acc["source"], color="k", lw=0.8, ls="--", zorder=1)
    if log:
      ax.set_xscale("log")
    ax.margins(x=0.15, y=0.08)
    _label_points(ax, [(x[m], acc[m], m) for m in methods])
    ax.set_xlabel(label)
    ax.set_ylabel("average accuracy (%)")
    ax.grid(alpha=0.3, which="both")
  fig.suptitle("accuracy against cost (Source: star, dashed line)", fontsize=10)
  return fig


def _label_points(ax, points: Sequence[tuple[float, float, str]]) -> None:
  """Each point's name to its right; a name that would overlap one placed before it (from the top point down) is
  moved down in steps until it overlaps none, with a thin line back to its point, so that 28 methods stay
  readable."""
  fig = ax.figure
  renderer = fig.canvas.get_renderer()
  px_to_pt = 72.0 / fig.dpi
  placed = []
  order = sorted(range(len(points)), key=lambda k: -ax.transData.transform(points[k][:2])[1])
  for k in order:
    x, y, name = points[k]
    text = ax.annotate(name, (x, y), xytext=(5, 0), textcoords="offset points", fontsize=7, va="center",
                       ha="left", annotation_clip=False)
    dy = 0.0
    for _ in range(200):
      box = text.get_window_extent(renderer)
      hit = next((b for b in placed if box.x0 < b.x1 and b.x0 < box.x1 and box.y0 < b.y1 and b.y0 < box.y1), None)
      if hit is None:
        break
      dy -= (box.y1 - hit.y0 + 1.0) * px_to_pt
      text.set_position((5, dy))
    if dy:
      text.arrow_patch = None
      ax.annotate("", (x, y), xytext=(5, dy), textcoords="offset points", annotation_clip=False,
                  arrowprops=dict(arrowstyle="-", lw=0.4, color="0.6", shrinkA=0, shrinkB=2))
    placed.append(text.get_window_extent(renderer))


def _running_panels(plt, curves: dict[str, Any], methods: Sequence[str]):
  """One panel per method (a line per seed). When Source ran beside others: Source's running accuracy first,
  then each method's running accuracy minus Source's on the same stream, every difference panel on one y range
  (methods a tenth of a point apart look apart); else each method's running accuracy, on one y range."""
  seeds = sorted({k.split("/", 1)[1] for k in curves})
  relative = "source" in methods and len(methods) > 1
  panels = []  # (method, title, [(seed index, seen, values in %)])
  for m in methods:
    lines = []
    for j, sd in enumerate(seeds):
      c, src = curves.get(f"{m}/{sd}"), curves.get(f"source/{sd}")
      if not (c and c["seen"]):
        continue
      acc = 100 * np.asarray(c["accuracy"])
      if relative and m != "source":
        if not (src and src["seen"] == c["seen"]):
          continue
        acc = acc - 100 * np.asarray(src["accuracy"])
      lines.append((j, c["seen"], acc))
    if lines:
      end = float(np.mean([v[-1] for _, _, v in lines]))
      title = (f"{m}: {end:.1f}% at the end" if not relative or m == "source" else
               f"{m} minus Source: {end:+.2f} points at the end")
      panels.append((m, title, lines))
  cols = max(1, min(len(panels), 4))
  rows = max(1, math.ceil(len(panels) / cols))
  fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.2, 2.6 * rows + 0.8), sharex=True, squeeze=False,
                           layout="constrained")
  for ax, (m, title, lines) in zip(axes.flat, panels):
    for j, seen, v in lines:
      ax.plot(seen, v, color=f"C{j}", lw=1.2, label=seeds[j] if len(seeds) > 1 else None)
    if relative and m != "source":
      ax.axhline(0, color="k", lw=0.8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  for group in [[k for k in range(len(panels)) if not relative or panels[k][0] != "source"]]:
    values = np.concatenate([v for k in group for _, _, v in panels[k][2]]) if group else np.zeros(0)
    if values.size:
      lo, hi = float(values.min()), float(values.max())
      pad = max(0.05 if relative else 0.5, 0.05 * (hi - lo))
      for k in group:
        axes.flat[k].set_ylim(lo - pad, hi + pad)
  fig.supxlabel("images seen", fontsize=9)
  fig.supylabel("running accuracy (%); minus Source's (points) beside Source" if relative else
                "running accuracy (%)", fontsize=9)
  if len(seeds) > 1 and panels:
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(seeds), fontsize=8, frameon=False)
  return fig


def plot(out_dir: str, records: Sequence[dict], curves: dict[str, Any], domains: Sequence[str],
         methods: Sequence[str], costs: dict | None = None) -> list[str]:
  """Writes `figures` into ``out_dir``; returns their paths."""
  import matplotlib.pyplot as plt

  paths = []
  for name, fig in figures(records, curves, domains, methods, costs).items():
    paths.append(os.path.join(out_dir, name))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
  return paths
