"""TensorBoard's event files of a run, read back with TensorBoard's own reader (`EventAccumulator`): each unit's
running accuracy per batch ends at its record's accuracy, its loss and img/s are there, each domain's accuracy and
the results' per-method accuracies are results.json's, the table is table.md; under --resume no step is written
twice and the curves are those of an uninterrupted run."""

from __future__ import annotations

import glob
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from pcsr_jax import harness
from test_harness import cfg, world  # noqa: F401 -- the harness tests' data world (a fixture) and its configs


def _cfg(world, out, **kw):  # noqa: F811 -- ``world`` is the fixture's value
  return cfg(world, out, **{"batch_size": 4, "methods": ("source", "tent"), **kw})


def _read(run_dir) -> EventAccumulator:
  acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
  acc.Reload()
  return acc


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
  acc = _read(run_dir)
  return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_events_hold_the_runs_curves_and_results(world, tmp_path):
  res = harness.run(_cfg(world, tmp_path), log=lambda *a: None)
  saved = json.loads((tmp_path / "results.json").read_text())
  tb = tmp_path / "tensorboard"
  for rec in saved["records"]:
    s = _scalars(tb / "units" / rec["method"] / "seed1" / rec["corruption"])
    steps = [step for step, _ in s["running_accuracy"]]
    assert steps == list(range(4, 21, 4)), steps  # a point per batch of 4, at the images scored
    assert s["running_accuracy"][-1][1] == pytest.approx(100 * rec["accuracy"], abs=1e-4)
    assert s[f"domain_accuracy/{rec['corruption']}"] == [(20, pytest.approx(100 * rec["accuracy"], abs=1e-4))]
    assert [step for step, _ in s["images_per_s"]] == steps and all(v > 0 for _, v in s["images_per_s"])
    if rec["method"] == "tent":
      assert [step for step, _ in s["loss"]] == steps
  for m in ("source", "tent"):
    s = _scalars(tb / "results" / m)
    recs = [r for r in saved["records"] if r["method"] == m]
    for r in recs:
      assert s[f"accuracy/{r['corruption']}"] == [(0, pytest.approx(100 * r["accuracy"], abs=1e-4))]
    assert s["accuracy/avg"][0][1] == pytest.approx(100 * sum(r["accuracy"] for r in recs) / len(recs), abs=1e-4)
  table = _read(tb / "table").Tensors("table")
  assert [t.tensor_proto.string_val[0].decode() for t in table] == [(tmp_path / "table.md").read_text()]
  assert res["complete"]


@pytest.mark.parametrize("setting", ["normal", "continual"])
def test_resumed_events_write_no_step_twice(world, tmp_path, monkeypatch, setting):
  """A run that dies at the third batch of fog (progress saved every second batch: at batch 2), then resumed:
  batch 3 runs again, yet the unit's run has each step once (its second file starts after batch 2), and its
  curves are the uninterrupted run's."""
  from pcsr_jax import runlog

  monkeypatch.setattr(runlog, "LINE_EVERY_S", 0.0)
  kw = dict(methods=("tent",), setting=setting, checkpoint_every=2)
  harness.run(_cfg(world, tmp_path / "full", **kw), log=lambda *a: None)
  key = "tent/seed1/fog" if setting == "normal" else "tent/seed1"

  def log(line, *a, **k):
    if line.startswith(f"{key}: batch {3 if setting == 'normal' else 8} of"):
      raise RuntimeError("the process dies here")

  out = tmp_path / "died"
  with pytest.raises(RuntimeError):
    harness.run(_cfg(world, out, progress=True, **kw), log=log)
  harness.run(_cfg(world, out, resume=True, **kw), log=lambda *a: None)
  run = os.path.join("units", *key.split("/"))
  assert len(glob.glob(str(out / "tensorboard" / run / "events.out.tfevents.*"))) == 2
  got, want = _scalars(out / "tensorboard" / run), _scalars(tmp_path / "full" / "tensorboard" / run)
  raw = [e.step for f in sorted(glob.glob(str(out / "tensorboard" / run / "events.out.tfevents.*")))
         for e in EventFileLoader(f).Load() for v in e.summary.value if v.tag == "running_accuracy"]
  assert raw == [step for step, _ in want["running_accuracy"]]  # the files as written: no step twice
  assert [step for step, _ in got["running_accuracy"]] == raw
  for tag in ("running_accuracy", "loss") + tuple(t for t in want if t.startswith("domain_accuracy/")):
    steps = [step for step, _ in got[tag]]
    assert len(steps) == len(set(steps)), (tag, steps)
    assert got[tag] == want[tag], tag  # bit-identical on a CPU
