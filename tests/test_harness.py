"""The harness end to end on generated ImageNet-C folders with a tiny 1000-class checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import float_checks
import harness_fixtures as hf
from pcsr_jax import checkpoint, harness, progress, results
from pcsr_jax.data import sources, streams, transforms
from pcsr_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORR = ("gaussian_noise", "fog")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return hf.make_world(tmp_path_factory.mktemp("world"), CORR, classes=4, per_class=5)


def cfg(world, out, **kw):
  base = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
              seeds=(1,), batch_size=8, progress=False)
  base.update(kw)
  return harness.RunConfig(**base)


def test_all_methods_normal_setting_outputs(world, tmp_path):
  res = harness.run(cfg(world, tmp_path, methods=("source", "tent", "sar", "pcsr", "pcsr-frozen"),
                        save_predictions=True), log=lambda *a: None)
  assert len(res["records"]) == 10 and {r["num_samples"] for r in res["records"]} == {20}
  for f in ("results.json", "results.csv", "table.md", "gain_over_source.png", "accuracy_per_corruption.png",
            "running_accuracy.png"):
    assert os.path.getsize(tmp_path / f) > 0, f
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["complete"] and data["config"]["setting"] == "normal" and "jax" in data["versions"]
  assert {r["eval_order"] for r in data["records"] if r["method"] == "pcsr"} == {"before"}
  assert {r["eval_order"] for r in data["records"] if r["method"] == "pcsr-frozen"} == {"after"}
  assert "| pcsr-frozen |" in res["table"] and "| pcsr |" in res["table"]  # variants are named apart
  assert all(r["resets"] == 0 for r in data["records"] if r["method"] in ("source", "tent", "pcsr-frozen"))
  assert all(isinstance(r["resets"], int) and 0 <= r["resets"] <= 3 for r in data["records"])  # 3 batches each
  assert os.path.exists(tmp_path / "predictions" / "pcsr-frozen_fog_5_seed1.npz")
  assert not (tmp_path / "resume").exists()
  # Source accuracy equals a direct forward of the checkpoint on the preprocessed images.
  model, params, meta = checkpoint.load(str(world / "ckpt"))
  pre = transforms.imagenet_c_preprocess(meta)
  for c in CORR:
    src = sources.imagenet_c_source(str(world / "data"), c, 5)
    x = np.stack([pre(src.load(i)) for i in range(len(src))])
    logits = np.asarray(jax.jit(model.apply)({"params": params}, x))  # one batch of 20, not the harness's 8s
    rec = next(r for r in res["records"] if r["method"] == "source" and r["corruption"] == c)
    float_checks.assert_accuracy_matches(rec["accuracy"], logits, np.asarray(src.labels))
    pred = np.load(tmp_path / "predictions" / f"source_{c}_5_seed1.npz")
    assert sorted(pred["file_names"].tolist()) == sorted(src.names) and len(pred["labels"]) == 20
    order = [src.names.index(n) for n in pred["file_names"].tolist()]
    np.testing.assert_array_equal(pred["labels"], np.asarray(src.labels)[order])
    float_checks.assert_predictions_match(pred["predictions"], logits[order])


@pytest.mark.parametrize("setting", [s for s in streams.SETTINGS if s not in ("gradual", "ccc")])  # own tests
def test_every_setting_runs(world, tmp_path, setting):
  res = harness.run(cfg(world, tmp_path, methods=("tent",), setting=setting, limit=40), log=lambda *a: None)
  recs = res["records"]
  assert [r["corruption"] for r in recs] == list(CORR) and all(r["setting"] == setting for r in recs)
  expected = 40 if setting == "label_shifts" else 20  # label shifts draw 4 classes x 100 (limited to 40)
  assert all(r["num_samples"] == expected for r in recs), recs


def test_gradual_setting_walks_severities_without_reset(tmp_path):
  """RMT's gradual setting: each corruption at severities 1..5..1 (9 shuffled passes), one model for the whole
  stream; one record per pass, the table averages a corruption's 9, and no two passes share a predictions file."""
  for sev in streams.SEVERITIES:
    hf.make_imagenet_c(str(tmp_path / "data"), CORR, severity=sev, classes=2, per_class=2, seed=sev)
  hf.make_checkpoint(str(tmp_path / "ckpt"))
  segs = streams.build("gradual", [4] * 10, [np.zeros(4)] * 10,
                       [streams.gradual_domain(c, s) for c in CORR for s in streams.SEVERITIES], seed=0)
  assert [s.name for s in segs] == [f"{c}@{v}" for c in CORR for v in streams.GRADUAL]
  assert [s.reset for s in segs] == [True] + [False] * 17
  assert all(sorted(s.indices) == [0, 1, 2, 3] for s in segs) and segs[0].source_ids[0] == 0
  res = harness.run(harness.RunConfig(data=str(tmp_path / "data"), checkpoint=str(tmp_path / "ckpt"),
                                      output=str(tmp_path / "out"), corruptions=CORR, seeds=(1,), batch_size=4,
                                      progress=False, methods=("source", "tent"), setting="gradual",
                                      save_predictions=True), log=lambda *a: None)
  for m in ("source", "tent"):
    recs = [r for r in res["records"] if r["method"] == m]
    assert [(r["corruption"], r["severity"]) for r in recs] == [(c, v) for c in CORR for v in streams.GRADUAL]
    assert [r["segment"] for r in recs] == list(range(18)) and all(r["num_samples"] == 4 for r in recs)
    row = next(l for l in res["table"].splitlines() if l.startswith(f"| {m} |"))
    means = [np.mean([100 * r["accuracy"] for r in recs if r["corruption"] == c]) for c in CORR]
    assert row == f"| {m} | {means[0]:.1f} | {means[1]:.1f} | {np.mean(means):.1f} |", row
  assert len(os.listdir(tmp_path / "out" / "predictions")) == 36
  # Source sees the same images at a severity twice (up and down), so predicts them the same way.
  up, down = (np.load(tmp_path / "out" / "predictions" / f"source_fog-segment{k}_3_seed1.npz") for k in (11, 15))
  order = np.argsort(up["file_names"]), np.argsort(down["file_names"])
  np.testing.assert_array_equal(up["predictions"][order[0]], down["predictions"][order[1]])


def test_unreadable_image_is_skipped_and_counted(world, tmp_path):
  import shutil

  data = tmp_path / "data"
  shutil.copytree(world / "data", data)
  victim = next((data / "fog" / "5").rglob("*.JPEG"))
  victim.write_bytes(victim.read_bytes()[:40])  # truncated JPEG
  res = harness.run(cfg(world, tmp_path / "out", data=str(data), methods=("source",)), log=lambda *a: None)
  fog = next(r for r in res["records"] if r["corruption"] == "fog")
  assert fog["num_samples"] == 19 and fog["num_skipped"] == 1 and len(res["skipped"]) == 1
  assert json.loads((tmp_path / "out" / "results.json").read_text())["skipped"][0].startswith("fog/")


def test_table_and_csv_writers(tmp_path):
  recs = [dict(method=m, setting="normal", corruption=c, severity=5, seed=s, eval_order="before",
               accuracy=acc, num_samples=10, num_skipped=0, seconds=1.0)
          for m, base in (("source", 0.5), ("pcsr", 0.7)) for s, d in ((1, 0.0), (2, 0.02))
          for c, acc in (("gaussian_noise", base + d), ("fog", base + 2 * d))]
  tbl = results.table(recs, ["gaussian_noise", "fog"], ["source", "pcsr"])
  lines = tbl.strip().splitlines()
  assert lines[0] == "| Method | gaus | fg | Avg. |"
  assert lines[2] == "| source | 51.0 ± 1.0 | 52.0 ± 2.0 | 51.5 ± 1.5 |"
  assert lines[3].startswith("| pcsr | 71.0 ± 1.0 |")
  results.write_csv(str(tmp_path / "r.csv"), recs)
  import csv

  rows = list(csv.DictReader(open(tmp_path / "r.csv")))
  assert len(rows) == 8 and rows[0]["method"] == "source" and float(rows[0]["accuracy"]) == 0.5


def cli(*args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                        capture_output=True, text=True, timeout=timeout)


def test_bad_input_matrix(world, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  bad_ckpt = tmp_path / "notackpt"
  bad_ckpt.mkdir()
  ckpt10 = hf.make_checkpoint(str(tmp_path / "ckpt10"), hf.CKPT_CFG.__class__(**{**hf.CKPT_CFG.to_dict(),
                                                                                 "num_classes": 10}))
  d, c = str(world / "data"), str(world / "ckpt")
  cases = {
      "data dir not found": ["--data", str(tmp_path / "missing"), "--checkpoint", c],
      "data dir is empty": ["--data", str(empty), "--checkpoint", c],
      "corruption folder 'snow' not found": ["--data", d, "--checkpoint", c, "--corruptions", "snow"],
      "severity folder '3' not found": ["--data", d, "--checkpoint", c, "--corruptions", "fog", "--severity", "3"],
      "not a pcsr-jax checkpoint": ["--data", d, "--checkpoint", str(bad_ckpt), "--corruptions", "fog"],
      "the checkpoint's head has 10 classes": ["--data", d, "--checkpoint", ckpt10, "--corruptions", "fog"],
      "unknown method 'no-such-method'": ["--data", d, "--checkpoint", c, "--methods", "tent,no-such-method"],
      "unknown setting 'wild'": ["--data", d, "--checkpoint", c, "--setting", "wild"],
  }
  for expected, args in cases.items():
    out = tmp_path / f"out_{abs(hash(expected))}"
    if expected in ("unknown method 'no-such-method'", "data dir not found"):  # two through the real CLI process
      r = cli(*args, "--output", str(out))
      assert r.returncode == 2, (expected, r.stderr)
      assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    else:
      from pcsr_jax.experiments.imagenet_c import main

      with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        main([*args, "--output", str(out), "--no-progress"])
    assert not (out / "results.json").exists()


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(world, tmp_path):
  args = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt"), "--corruptions", ",".join(CORR),
          "--methods", "tent,pcsr", "--seeds", "1", "--batch-size", "4", "--checkpoint-every", "1",
          "--save-predictions", "--no-progress"]
  full = cli(*args, "--output", str(tmp_path / "full"))
  assert full.returncode == 0, full.stderr
  out = tmp_path / "killed"
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args, "--output",
                        str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline:  # kill in the middle of the second method's stream
    if any(u["key"].startswith("pcsr") and u["batch"] >= 2 for u in hf.open_units(out)):
      break
    time.sleep(0.05)
  else:
    pytest.fail("the run never reached the kill point")
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert not (out / "results.json").exists()
  resumed = cli(*args, "--output", str(out), "--resume")
  assert resumed.returncode == 0, resumed.stderr
  assert "resuming from" in resumed.stdout
  a = json.loads((tmp_path / "full" / "results.json").read_text())["records"]
  b = json.loads((out / "results.json").read_text())["records"]
  key = lambda r: (r["method"], r["corruption"], r["seed"])
  assert sorted((key(r), r["accuracy"], r["num_samples"]) for r in a) == \
      sorted((key(r), r["accuracy"], r["num_samples"]) for r in b)
  for f in os.listdir(tmp_path / "full" / "predictions"):
    x, y = np.load(tmp_path / "full" / "predictions" / f), np.load(out / "predictions" / f)
    for k in ("file_names", "labels", "predictions"):
      np.testing.assert_array_equal(x[k], y[k], err_msg=f"{f}:{k}")


def test_loader_processes_same_results_and_ctrl_c_of_the_process_group_saves_progress(world, tmp_path):
  """``--loader processes``: Ctrl-C reaches the decode workers too (one process group), yet the run saves its
  progress at the next batch and exits 130; resumed, it gives the thread loader's predictions, bit for bit."""
  args = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt"), "--corruptions", ",".join(CORR),
          "--methods", "tent", "--seeds", "1", "--batch-size", "2", "--checkpoint-every", "1", "--workers", "2",
          "--save-predictions", "--no-progress"]
  full = cli(*args, "--output", str(tmp_path / "full"))
  assert full.returncode == 0, full.stderr
  out = tmp_path / "stopped"
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args, "--loader",
                        "processes", "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:  # stop in the middle of the first corruption
    if any(u["batch"] >= 2 for u in hf.open_units(out)):
      break
    time.sleep(0.02)
  assert p.poll() is None, "the run ended before the stop point"
  os.killpg(p.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the harness and every decode worker
  stdout, stderr = p.communicate(timeout=300)
  assert p.returncode == 130, stderr
  assert "interrupted: progress saved" in stdout + stderr
  assert "SIGINT: stopping; each unit's progress is saved at its last finished batch" in stdout
  resumed = cli(*args, "--loader", "processes", "--output", str(out), "--resume")
  assert resumed.returncode == 0, resumed.stderr
  assert "resuming from" in resumed.stdout
  for f in os.listdir(tmp_path / "full" / "predictions"):
    x, y = np.load(tmp_path / "full" / "predictions" / f), np.load(out / "predictions" / f)
    for k in ("file_names", "labels", "predictions"):
      np.testing.assert_array_equal(x[k], y[k], err_msg=f"{f}:{k}")


@pytest.mark.parametrize("slow", [True, False])
def test_a_stop_saves_the_last_finished_batch_and_says_so_at_once(world, tmp_path, monkeypatch, slow):
  """SIGINT during a unit: the line that says the run stops comes at once (before any further batch line), the
  batch after the signal is not run, the progress is saved at the last finished batch, and the resumed run gives
  the uninterrupted records. ``slow``: every step counts as long (`harness.SLOW_STEP_S` 0), so each is awaited
  before the next is queued."""
  from pcsr_jax import runlog

  monkeypatch.setattr(runlog, "LINE_EVERY_S", 0.0)  # a line per batch
  if slow:
    monkeypatch.setattr(harness, "SLOW_STEP_S", 0.0)
  full = harness.run(cfg(world, tmp_path / "full", methods=("tent",), batch_size=4), log=lambda *a: None)
  lines = []

  def log(line, *a, **k):
    lines.append(line)
    if line.startswith("tent/seed1/fog: batch 2 of"):
      os.kill(os.getpid(), signal.SIGINT)  # the handler runs as this returns, before the next batch

  out = tmp_path / "stopped"
  with pytest.raises(SystemExit) as e:
    harness.run(cfg(world, out, methods=("tent",), batch_size=4, progress=True), log=log)
  assert e.value.code == 130
  k = next(i for i, l in enumerate(lines) if l.startswith("tent/seed1/fog: batch 2 of"))
  assert lines[k + 1].startswith("SIGINT: stopping; each unit's progress is saved at its last finished batch")
  assert not any(l.startswith("tent/seed1/fog: batch 3 of") for l in lines)
  assert [(u["key"], u["batch"]) for u in hf.open_units(out)] == [("tent/seed1/fog", 2)]
  resumed = harness.run(cfg(world, out, methods=("tent",), batch_size=4, resume=True), log=lambda *a: None)
  assert [(r["corruption"], r["accuracy"]) for r in resumed["records"]] == \
      [(r["corruption"], r["accuracy"]) for r in full["records"]]


def test_a_resume_under_other_settings_says_how_to_keep_the_progress(world, tmp_path, monkeypatch):
  """A refused ``--resume`` names each setting that differs with its saved and its new value, and never advises
  a step that discards the saved progress without saying so; a unit saved on another number of devices (another
  executor or device groups: not part of the key) continues, and the log says so."""
  from pcsr_jax import runlog

  monkeypatch.setattr(runlog, "LINE_EVERY_S", 0.0)

  def log(line, *a, **k):
    if line.startswith("tent/seed1/fog: batch 2 of"):
      os.kill(os.getpid(), signal.SIGINT)

  out = tmp_path / "o"
  with pytest.raises(SystemExit):
    harness.run(cfg(world, out, methods=("tent",), batch_size=4, progress=True), log=log)
  with pytest.raises(UserError, match=r"progress.json: saved progress is from a different configuration "
                                      r"\(batch_size: saved 4, now 8\); to continue it, rerun with the saved "
                                      r"settings; or give another --output \(a run here without --resume starts "
                                      r"over and discards the saved progress\)$"):
    harness.run(cfg(world, out, methods=("tent",), batch_size=8, resume=True), log=lambda *a: None)
  [(path, rec)] = [(p, r) for p in (out / "resume" / "units").glob("*/unit.json")
                   if (r := json.loads(p.read_text()))["progress"]]  # the unit under way
  assert rec["devices"] == 1
  path.write_text(json.dumps(dict(rec, devices=3)))  # as a run whose unit split its batches over 3 devices
  lines = []
  harness.run(cfg(world, out, methods=("tent",), batch_size=4, resume=True), log=lambda line, *a, **k:
              lines.append(line))
  assert ("tent/seed1/fog: saved on 3 device(s), continuing on 1: the rest of it splits each batch over another "
          "number of devices, which rounds sums differently (float32); finished units are unaffected") in lines


def test_tfds_path_with_mock_data(world, tmp_path):
  import tensorflow_datasets as tfds

  with tfds.testing.mock_data(num_examples=6):
    src = sources.TFDSSource("fog", 5)
    assert len(src) == 6 and src.load(0).size == (224, 224)
    assert list(src.labels) == sorted(src.labels)  # (label, file name) order, as Hendrycks' folders
    meta = dict(img_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bicubic", crop_pct=0.9)
    assert transforms.imagenet_c_preprocess(meta)(src.load(0)).shape == (32, 32, 3)
    res = harness.run(cfg(world, tmp_path, data="tfds", corruptions=("fog",), methods=("source",)),
                      log=lambda *a: None)
  assert res["records"][0]["num_samples"] == 6 and res["records"][0]["corruption"] == "fog"


def load_script(name):
  """The module whose ``main`` the command file ``experiments/<name>.py`` runs (its ``run_cli("module:main")``)."""
  import importlib

  with open(os.path.join(ROOT, "experiments", f"{name}.py")) as f:
    [module] = re.findall(r'run_cli\("([\w.]+):main"', f.read())
  return importlib.import_module(module)


@pytest.mark.slow
def test_preset_scripts_run(world, tmp_path, capsys):
  common = ["--checkpoint", str(world / "ckpt"), "--seeds", "1", "--batch-size", "8", "--no-progress", "--limit", "8"]
  d = ["--data", str(world / "data"), "--corruptions", "fog"]
  load_script("wild").main([*d, *common, "--methods", "tent", "--output", str(tmp_path / "wild")])
  assert "| label_shifts | tent |" in (tmp_path / "wild" / "summary.md").read_text()
  assert "| mix_shifts | tent |" in (tmp_path / "wild" / "summary.md").read_text()
  load_script("ablations").main([*d, *common, "--table", "qkv", "--output", str(tmp_path / "abl")])
  summary = (tmp_path / "abl" / "summary.md").read_text()
  assert "| qkv=independent | pcsr |" in summary and "| qkv=shared | pcsr |" in summary
  r_root = hf.make_imagenet_r(str(tmp_path / "imagenet-r"))
  load_script("imagenet_rav").main(["--imagenet-r", str(r_root), *common, "--methods", "source",
                                    "--output", str(tmp_path / "rav")])
  rec = json.loads((tmp_path / "rav" / "imagenet_r" / "results.json").read_text())["records"][0]
  assert rec["corruption"] == "imagenet_r" and rec["num_samples"] == 8


def test_visda_reports_all_sample_and_known_class_accuracy(tmp_path):
  from test_data import make_visda

  make_visda(tmp_path / "visda", np.random.default_rng(1))
  hf.make_checkpoint(str(tmp_path / "ckpt"))
  res = harness.run(harness.RunConfig(data=str(tmp_path / "visda"), checkpoint=str(tmp_path / "ckpt"),
                                      output=str(tmp_path / "out"), dataset="visda", methods=("source",),
                                      seeds=(1,), batch_size=4, save_predictions=True, progress=False),
                    log=lambda *a: None)
  (rec,) = res["records"]
  pred = np.load(tmp_path / "out" / "predictions" / "source_visda_5_seed1.npz")
  known = pred["labels"] < 1000
  hits = pred["predictions"] == pred["labels"]
  assert rec["num_samples"] == 9 and rec["num_known"] == known.sum() == 6
  assert rec["accuracy"] == hits.sum() / 9 and rec["accuracy_known"] == hits[known].sum() / 6
  assert not hits[~known].any()  # label 1000 is never predicted: those samples always count as wrong


@pytest.mark.parametrize("setting", ["normal", "continual"])
def test_progress_is_one_line_per_domain_without_a_terminal(world, tmp_path, setting):
  """One line per finished domain, whether the unit is the domain (normal) or the whole stream (continual), and
  one per method and seed at the end: never a second line for the same domain."""
  lines = []
  harness.run(cfg(world, tmp_path, methods=("source",), progress=True, setting=setting), log=lines.append)
  seg = [l for l in lines if l.startswith("source/seed1 ")]
  assert [l.split(":")[0] for l in seg] == [f"source/seed1 {c}" for c in CORR]
  assert "running" in seg[0] and "over 20 images" in seg[0] and "over 40 images" in seg[1]
  done = [f"units {k} of {len(CORR)} done" for k in range(1, len(CORR) + 1)] if setting == "normal" else \
      ["units 0 of 1 done"] * (len(CORR) - 1) + ["units 1 of 1 done"]
  assert [l.split("; ")[-1].split(",")[0] for l in seg] == done
  assert [l for l in lines if l.startswith("source/seed1:")] == [
      next(l for l in lines if l.startswith("source/seed1:"))]  # the method and seed's line, once


def test_the_log_file_the_domain_lines_the_minute_lines_and_the_table_caption(world, tmp_path, monkeypatch):
  """Every line the run logs is also in <output>/log.txt; each domain's line gives its own accuracy (the record's)
  and the running one; without a terminal a progress line comes at least every `runlog.LINE_EVERY_S` (0 here:
  every batch); table.md says what its numbers are. A resumed run appends to the log."""
  from pcsr_jax import runlog

  monkeypatch.setattr(runlog, "LINE_EVERY_S", 0.0)
  lines = []
  res = harness.run(cfg(world, tmp_path, methods=("source",), progress=True, batch_size=4), log=lines.append)
  logged = (tmp_path / "log.txt").read_text()
  stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # every entry of log.txt after its time; a table on the next line
  entries = [stamp + ("\n" if "\n" in line.rstrip() else " ") + re.escape(line) + "\n" for line in lines]
  assert re.fullmatch("".join(entries), logged), logged[:2000]
  assert lines[0].startswith("run into ") and "methods source; seed 1; setting normal" in lines[0]
  units = len(res["records"])
  for k, rec in enumerate(res["records"]):  # one line per domain, with the unit done
    c = rec["corruption"]
    [line] = [l for l in lines if l.startswith(f"source/seed1 {c}:")]
    assert re.fullmatch(rf"source/seed1 {c}: accuracy {100 * rec['accuracy']:.1f}% \(20 images\); running "
                        rf"\d+\.\d% over {20 * (k + 1)} images; \d+\.\d img/s; units {k + 1} of {units} done"
                        rf"(, about .* left)?", line), line
  batch_lines = [l for l in lines if l.startswith("source/seed1/") and ": batch " in l]  # a unit per domain
  assert [l.split(" (")[0] for l in batch_lines] == [f"source/seed1/{r['corruption']}: batch {k} of 5"
                                                     for r in res["records"] for k in range(1, 6)]
  caption = (tmp_path / "table.md").read_text().split("\n")[0]
  assert caption.startswith("Online accuracy (%) of each method on each domain and their average (severity 5, "
                            "setting normal), one seed (1), no std; 20 images per domain")
  harness.run(cfg(world, tmp_path, methods=("source",), resume=True), log=lambda *a: None)
  again = (tmp_path / "log.txt").read_text()
  assert again.startswith(logged) and len(again) > len(logged)


def test_unit_progress_json_round_trip():
  u = progress.UnitProgress(key="sar/seed1", segment=1, batch=3, seen=40, correct=7, skipped=1, seconds=0.5,
                           total_seconds=2.0, counts={"fog": [1, 2, 1, 2]}, preds={"fog": [["a"], [1], [1]]})
  back = progress.UnitProgress.from_json(json.loads(json.dumps(u.to_json())))
  assert back == u
  r = progress.UnitRecord("sar/seed1", source_key="none", progress=u, records=[{"a": 1}], state_dir="state_1",
                          curve={"seen": [4], "correct": [1]}, skipped=["fog/x.JPEG"])
  assert progress.UnitRecord.from_json(json.loads(json.dumps(r.to_json()))) == r
  u.close_segment()
  assert (u.segment, u.batch, u.seconds, u.skipped, u.total_seconds) == (2, 0, 0.0, 0, 2.5)


def test_auto_loader_takes_processes_only_on_an_accelerator_host_with_cores_and_picklable_sources(monkeypatch):
  import threading

  from pcsr_jax import run_setup
  from pcsr_jax.data.loader import Loader

  data, locked = Loader([list(range(4))], abs, 4), Loader([threading.Lock()], abs, 4)
  assert run_setup.loader_kind("threads", data) == "threads"
  assert run_setup.loader_kind("processes", data) == "processes"
  assert jax.default_backend() == "cpu" and run_setup.loader_kind("auto", data) == "threads"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(run_setup.os, "cpu_count", lambda: 16)
  assert run_setup.loader_kind("auto", data) == "processes"
  assert run_setup.loader_kind("auto", locked) == "threads"  # cannot reach a worker
  monkeypatch.setattr(run_setup.os, "cpu_count", lambda: 4)
  assert run_setup.loader_kind("auto", data) == "threads"
  with pytest.raises(UserError, match="--loader: expected threads, processes or auto, got 'fast'"):
    harness.RunConfig(data="x", checkpoint="y", output="z", loader="fast").validate()
