"""The realistic online protocol (`--realtime`, `pcsr_jax.realtime`) and every run's cost fields (`pcsr_jax.cost`):
the skip schedule for a fixed C, a skipped batch's logits, a slow method's measured C, --resume mid-run under a
clock, the cost fields of every registered method and of a run's outputs, and bad flags as one line."""

from __future__ import annotations

import csv
import json
import os
import signal
from typing import ClassVar

import jax
import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import checkpoint, cost, engine, harness, methods, realtime
from pcsr_jax.data import sources, transforms
from pcsr_jax.errors import UserError
from pcsr_jax.methods.source import Source
from tiny import batches, required_args, tiny_model

CORR = ("gaussian_noise", "fog")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return hf.make_world(tmp_path_factory.mktemp("realtime"), CORR, classes=4, per_class=5)


def cfg(world, out, **kw):
  base = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
              seeds=(1,), batch_size=4, progress=False, shuffle=False, methods=("tent",), cost_batches=2)
  base.update(kw)
  return harness.RunConfig(**base)


# ---------------------------------------------------------------- the pure pieces


@pytest.mark.core
def test_schedule_and_relative_cost():
  assert all(realtime.adapts(b, 1) for b in range(20))
  assert [b for b in range(10) if realtime.adapts(b, 3)] == [0, 3, 6, 9]
  assert [realtime.adapted_batches(n, 3) for n in (1, 3, 4, 7)] == [1, 1, 2, 3]
  assert realtime.relative_cost(1.0, 1.0) == 1 and realtime.relative_cost(1.01, 1.0) == 2
  assert realtime.relative_cost(0.2, 1.0) == 1 and realtime.relative_cost(2.5, 1.0) == 3
  assert realtime.reveal_seconds(256.0, 64, None) == 0.25 and realtime.reveal_seconds("source", 64, 0.03) == 0.03
  assert realtime.parse_rate("source") == "source" and realtime.parse_rate("250") == 250.0
  assert realtime.parse_costs("tent=2, sar=3") == {"tent": 2, "sar": 3}


@pytest.mark.core
@pytest.mark.parametrize("flags, message", [
    (["--realtime", "fast"], "--realtime: expected 'source' or a positive number of images per second, got 'fast'"),
    (["--realtime", "-5"], "--realtime: expected 'source' or a positive number of images per second, got '-5'"),
    (["--realtime", "source", "--realtime-cost", "tent=0"], "--realtime-cost: tent's cost must be a positive integer"),
    (["--realtime", "source", "--realtime-cost", "tent"], "--realtime-cost: expected METHOD=C,..."),
    (["--realtime-cost", "tent=2"], "--realtime-cost: fixes the costs of --realtime's protocol; give --realtime too"),
])
def test_bad_realtime_flags_are_one_line_before_jax(flags, message):
  from test_cli_start import _probe

  r = _probe(*flags)
  assert "HEAVY []" in r.stdout, (r.stdout[-500:], r.stderr[-2000:])
  assert message in r.stderr, r.stderr
  assert len([line for line in r.stderr.splitlines() if line.startswith("MESSAGE")]) == 1


# ---------------------------------------------------------------- the Adapter's forward-only prediction


def test_c3_adapts_on_batches_0_3_6_and_predicts_the_others_with_the_latest_params():
  """TENT at C = 3 over 8 batches: its state is that of stepping on batches 0, 3, 6 only, and a skipped batch's
  logits are a plain forward (`model.apply`) of the params adapted so far."""
  model, params = tiny_model()
  xs = batches(8, 8, seed=3)
  ad = engine.Adapter(methods.get("tent"), model, params, batch_size=8)
  state, skipped = ad.init_state(), 0
  apply = jax.jit(model.apply)
  for b, x in enumerate(xs):
    if realtime.adapts(b, 3):
      state, _, _ = ad.step(state, x)
    else:
      logits = np.asarray(ad.predict(state, x))
      np.testing.assert_allclose(logits, np.asarray(apply({"params": ad.params(state)}, x)), rtol=1e-5, atol=1e-6)
      skipped += 1
  assert skipped == 5
  only, ref = ad.init_state(), ad.init_state()
  for b in (0, 3, 6):
    only, _, _ = ad.step(only, xs[b])
  for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(only.trainable)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(ref.trainable)))  # it adapted


# ---------------------------------------------------------------- through the harness


def _stream(world, corruption):
  """The run's stream of ``corruption`` in file order (``shuffle=False``) as normalized float batches of 4."""
  model, params, meta = checkpoint.load(str(world / "ckpt"))
  pre = transforms.imagenet_c_preprocess(meta)
  src = sources.imagenet_c_source(str(world / "data"), corruption, 5)
  x = np.stack([pre(src.load(i)) for i in range(len(src))])
  return model, params, [x[i:i + 4] for i in range(0, len(x), 4)]


def test_realtime_c1_is_the_ordinary_run_and_c3_follows_the_schedule(world, tmp_path):
  """``--realtime-cost tent=1`` gives the ordinary run's predictions bit for bit; ``tent=3`` gives the
  predictions of the Adapter stepping on batches 0 and 3 of each domain and predicting the rest with a forward,
  which differ from the ordinary run's (TENT at lr 0.1 moves the tiny model's predictions within 5 batches)."""
  fast = {"tent": {"lr": 0.1}}
  plain = harness.run(cfg(world, tmp_path / "plain", save_predictions=True, method_args=fast), log=lambda *a: None)
  one = harness.run(cfg(world, tmp_path / "one", save_predictions=True, realtime="source",
                        realtime_cost={"tent": 1}, method_args=fast), log=lambda *a: None)
  hf.same_predictions(tmp_path / "plain", tmp_path / "one")
  assert [r["accuracy"] for r in plain["records"]] == [r["accuracy"] for r in one["records"]]
  three = harness.run(cfg(world, tmp_path / "three", save_predictions=True, realtime=100.0,
                          realtime_cost={"tent": 3}, method_args=fast), log=lambda *a: None)
  assert three["costs"]["tent"]["realtime_c"] == 3 and three["costs"]["tent"]["realtime_c_from"] == "--realtime-cost"
  assert (three["costs"]["tent"]["adapted_batches"], three["costs"]["tent"]["batches"]) == (4, 10)  # 2 of 5, twice
  for c in CORR:
    model, params, xs = _stream(world, c)
    ad = engine.Adapter(methods.get("tent", lr=0.1), model, params, batch_size=4, seed=1)
    state, want = ad.init_state(), []
    for b, x in enumerate(xs):
      if realtime.adapts(b, 3):
        state, logits, _ = ad.step(state, x)
      else:
        logits = ad.predict(state, x)
      want.append(np.asarray(logits).argmax(-1))
    got = np.load(tmp_path / "three" / "predictions" / f"tent_{c}_5_seed1.npz")["predictions"]
    np.testing.assert_array_equal(got, np.concatenate(want))
    ordinary = np.load(tmp_path / "plain" / "predictions" / f"tent_{c}_5_seed1.npz")["predictions"]
    assert (got != ordinary).any(), c


class Slow(Source):
  """Source's prediction after 40 more forwards of the model, each fed by the last: a step many times a Source
  forward's."""

  name: ClassVar[str] = "slow"

  def update(self, prep, frozen, state, images, valid):
    def more(_, x):
      logits, _ = self.forward(prep, frozen, state.trainable, x)
      return x + 1e-6 * logits.mean()

    images = jax.lax.fori_loop(0, 40, more, images)
    return super().update(prep, frozen, state, images, valid)


def test_a_slow_method_gets_c_above_1_and_adapts_on_fewer_batches(world, tmp_path, monkeypatch):
  monkeypatch.setitem(methods.REGISTRY, "slow", (Slow, {}))
  lines = []
  res = harness.run(cfg(world, tmp_path, methods=("source", "slow"), realtime="source"), log=lines.append)
  c = res["costs"]
  assert c["source"]["realtime_c"] == 1 and c["source"]["adapted_batches"] == c["source"]["batches"] == 10
  assert c["slow"]["realtime_c_from"] == "measured" and c["slow"]["realtime_c"] > 1, c["slow"]
  assert c["slow"]["adapted_batches"] < 10
  assert c["slow"]["step_s_median"] > c["source"]["step_s_median"]
  assert any(line.startswith("slow: step ") and f"C = {c['slow']['realtime_c']} (measured)" in line for line in lines)
  assert "| C | adapted batches |" in (tmp_path / "table.md").read_text()


def test_resume_mid_run_under_realtime_equals_the_uninterrupted_run(world, tmp_path, monkeypatch):
  """Stopped at fog's batch 2 under a measured C, resumed: the saved C is kept (not measured again) and the
  predictions equal an uninterrupted run at that C."""
  from pcsr_jax import runlog

  monkeypatch.setattr(runlog, "LINE_EVERY_S", 0.0)  # a line per batch
  lines = []

  def log(line, *a, **k):
    lines.append(line)
    if line.startswith("tent/seed1/fog: batch 2 of"):
      os.kill(os.getpid(), signal.SIGINT)

  out = tmp_path / "stopped"
  kw = dict(methods=("source", "tent"), save_predictions=True, realtime="source", checkpoint_every=1)
  with pytest.raises(SystemExit) as e:
    harness.run(cfg(world, out, progress=True, **kw), log=log)
  assert e.value.code == 130
  saved = json.loads((out / "resume" / cost.FILE).read_text())
  assert saved["tent"]["realtime_c"] >= 1 and saved["_reveal"]["rate"] == "source"
  lines = []
  resumed = harness.run(cfg(world, out, resume=True, **kw), log=lines.append)
  assert not any(line.startswith(("source: step", "tent: step")) for line in lines)  # nothing measured again
  c = saved["tent"]["realtime_c"]
  assert resumed["costs"]["tent"]["realtime_c"] == c
  full = harness.run(cfg(world, tmp_path / "full", realtime="source", realtime_cost={"tent": c},
                         **{k: v for k, v in kw.items() if k != "realtime"}), log=lambda *a: None)
  hf.same_predictions(out, tmp_path / "full")
  assert [r["accuracy"] for r in resumed["records"]] == [r["accuracy"] for r in full["records"]]


def test_every_run_records_its_costs_in_every_output(world, tmp_path):
  """Without --realtime: results.json, results.csv, the cost table in table.md, the log, TensorBoard and the plot."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  lines = []
  harness.run(cfg(world, tmp_path, methods=("source", "tent")), log=lines.append)
  data = json.loads((tmp_path / "results.json").read_text())
  for m in ("source", "tent"):
    c = data["costs"][m]
    for k in ("step_s_median", "step_s_p90", "images_per_s", "peak_memory_bytes", "step_memory_bytes"):
      assert c[k] > 0, (m, k, c)
    assert c["compile_s"] >= 0 and c["step_s_p90"] >= c["step_s_median"] and c["cost_batches"] == 2
    assert c["peak_memory_kind"] == "process peak RSS (CPU)" and "realtime_c" not in c
    assert c["devices"] == data["costs"]["source"]["devices"] and c["devices"].endswith(" x cpu")
    assert any(line.startswith(f"{m}: step ") for line in lines)
  assert not any("step_s_median" in r for r in data["records"])  # records stay comparable between runs
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert all(float(r["images_per_s"]) > 0 and int(r["peak_memory_bytes"]) > 0 for r in rows)
  table = (tmp_path / "table.md").read_text()
  assert "| Method | step ms (median) | step ms (p90) | img/s | compile s | peak MiB | step MiB |" in table
  assert f"Cost of each method's step on {data['costs']['source']['devices']}: after compilation" in table
  assert "| C |" not in table and os.path.getsize(tmp_path / "accuracy_vs_cost.png") > 0
  acc = EventAccumulator(str(tmp_path / "tensorboard" / "costs" / "tent"))
  acc.Reload()
  assert {"cost/step_ms_median", "cost/images_per_s", "cost/peak_memory_mib"} <= set(acc.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(methods.REGISTRY))
def test_cost_fields_are_present_and_positive_for_every_method(name):
  """Every registered method's step and forward-only prediction, probed on the tiny model (2 timed steps)."""
  from test_engine import _adapter

  model, params = tiny_model()
  ad = _adapter(name, model, params, batch_size=8)
  placed = ad.place(batches(1, 8, seed=5)[0])
  c = cost.probe(ad, placed, 2, predict=True)
  for k in ("step_s_median", "step_s_p90", "images_per_s", "peak_memory_bytes", "step_memory_bytes"):
    assert c[k] > 0, (k, c)
  assert c["compile_s"] >= 0 and c["cost_batches"] == 2
  logits, metrics = ad.predict_placed(ad.init_state(), placed)
  assert logits.shape[0] == 8 and bool(metrics["finite"])


def test_realtime_cost_for_a_method_not_run_is_refused(world, tmp_path):
  with pytest.raises(UserError, match=r"^--realtime-cost: sar is not among the methods run \(tent\)$"):
    cfg(world, tmp_path, realtime="source", realtime_cost={"sar": 2}).validate()
