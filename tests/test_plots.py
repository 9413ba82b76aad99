"""The run's plots for one method and for five: every file written, no matplotlib warning (a run of one method
had 'No artists with labels found to put in legend'), every legend outside the axes, and one method per panel
of the running accuracy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pcsr_jax import plots
from pcsr_jax.data.imagenet import CORRUPTIONS

FIVE = ("source", "tent", "sar", "pcsr", "pcsr-frozen")


def _run(methods, seeds=(2022,), n=128):
  """Records and running curves of a made-up run: each method a little above Source, per domain."""
  rng = np.random.default_rng(0)
  records, curves = [], {}
  for s in seeds:
    for k, m in enumerate(methods):
      correct, seen, curve = 0, 0, {"seen": [], "accuracy": []}
      for c in CORRUPTIONS:
        acc = float(np.clip(0.5 + 0.01 * k + 0.02 * rng.standard_normal(), 0, 1))
        records.append(dict(method=m, seed=s, corruption=c, accuracy=acc, num_samples=n))
        for _ in range(2):  # two batches per domain
          seen += n // 2
          correct += int(acc * n / 2)
          curve["seen"].append(seen)
          curve["accuracy"].append(correct / seen)
      curves[f"{m}/seed{s}"] = curve
  return records, curves


def _overlaps(a, b) -> bool:
  return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("methods, seeds", [(("tent",), (2022,)), (("source",), (2022,)), (FIVE, (2022,)),
                                            (FIVE, (2022, 2023, 2024))])
def test_plots_are_written_without_warnings_and_with_legends_off_the_data(tmp_path, methods, seeds):
  records, curves = _run(methods, seeds)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    figs = plots.figures(records, curves, CORRUPTIONS, methods)
    for fig in figs.values():
      fig.canvas.draw()
      axes = [ax for ax in fig.axes if ax.get_visible()]
      legends = [ax.get_legend() for ax in axes if ax.get_legend()] + list(fig.legends)
      for leg in legends:
        box = leg.get_window_extent()
        assert not any(_overlaps(box, ax.get_window_extent()) for ax in axes), "a legend covers the data"
    panels = [ax for ax in figs["running_accuracy.png"].axes if ax.get_visible()]
    titles = [ax.get_title() for ax in panels]
    assert [t.split(":")[0].split(" minus ")[0] for t in titles] == list(methods)  # one method per panel
    relative = "source" in methods and len(methods) > 1  # beside Source: the others' panels are the difference
    assert [" minus Source: " in t for t in titles] == [relative and m != "source" for m in methods]
    assert [len(ax.lines) for ax in panels] == [len(seeds) + (relative and m != "source") for m in methods]
    paths = plots.plot(str(tmp_path), records, curves, CORRUPTIONS, methods)
  assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
  want = [p for p in plots.PLOTS if p != "accuracy_vs_cost.png"]  # without costs: no cost plot
  want = want[1:] if len(methods) == 1 else want  # gain over Source: only beside Source
  assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(want)
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  if "source" in methods and len(methods) > 1:
    gain = figs["gain_over_source.png"].axes[1]  # along the stream: each method minus Source, so tent's 1 point
    tent = next(line for line in gain.lines if line.get_label() == "tent")
    assert 0.0 < float(np.mean(tent.get_ydata())) < 3.0


def _costs(methods) -> dict:
  """Made-up costs (`pcsr_jax.cost`'s fields): images/s over three decades, memory over one."""
  rng = np.random.default_rng(1)
  return {m: dict(images_per_s=float(10 ** rng.uniform(0.5, 3.5)), step_memory_bytes=int(rng.uniform(1, 40) * 2 ** 20),
                  peak_memory_bytes=int(1e9), step_s_median=0.1, step_s_p90=0.12, compile_s=1.0)
          for m in methods}


@pytest.mark.parametrize("n", [5, 28])
def test_accuracy_against_cost_one_labelled_point_per_method_source_marked(tmp_path, n):
  """``accuracy_vs_cost.png``: two panels (images/s on a log axis, memory), a point and a name per method, Source
  a star; with 28 methods no two names overlap."""
  import matplotlib.pyplot as plt

  from pcsr_jax import methods as registry

  plt.close("all")  # the figures of the tests before (matplotlib warns past 20 open)
  names = ("source",) + tuple(m for m in registry.REGISTRY if m != "source")[:n - 1]
  records, curves = _run(names)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    figs = plots.figures(records, curves, CORRUPTIONS, names, _costs(names))
    fig = figs["accuracy_vs_cost.png"]
    fig.canvas.draw()
    paths = plots.plot(str(tmp_path), records, curves, CORRUPTIONS, names, _costs(names))
  assert not [str(w.message) for w in caught]
  assert "accuracy_vs_cost.png" in [p.rsplit("/", 1)[1] for p in paths]
  speed, memory = fig.axes[:2]
  assert speed.get_xscale() == "log" and memory.get_xscale() == "linear"
  for ax in (speed, memory):
    labels = [t for t in ax.texts if t.get_text() in names]
    assert sorted(t.get_text() for t in labels) == sorted(names)
    assert len(ax.collections) == n  # one point per method
    star = [c for c in ax.collections if np.allclose(c.get_facecolor()[0][:3], 0)]
    assert len(star) == 1  # Source, in black
    boxes = [t.get_window_extent() for t in labels]
    assert not any(_overlaps(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), "two names overlap"
