"""A table's units on several device groups and workers (`pcsr_jax.units`): the plan, the claims on the shared
folder, and whole runs: two units at once on a 2-device CPU, two worker processes, a worker killed mid-unit and
taken over, all equal to one process running the units one after another, bit for bit; mismatched workers and
an output folder no other worker sees are refused in one line."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import harness, methods, progress, run_setup, units
from pcsr_jax.data import streams
from pcsr_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORR = ("gaussian_noise", "fog")


def segments(setting: str, n: int = 3) -> list:
  sizes = [8] * n
  return streams.build(setting, sizes, [np.arange(8) % 2] * n, [f"c{i}" for i in range(n)], 1)


def test_units_are_domains_where_every_domain_starts_from_the_source():
  ms = {m: methods.get(m) for m in ("tent", "cmf")}
  normal = units.plan("normal", (1, 2), ms, {1: segments("normal"), 2: segments("normal")})
  assert [u.key for u in normal[:4]] == ["tent/seed1/c0", "tent/seed1/c1", "tent/seed1/c2", "cmf/seed1"]
  assert [u.segments for u in normal[:4]] == [(0,), (1,), (2,), (0, 1, 2)] and normal[3].images == 24
  assert [u.key for u in normal[4:]] == ["tent/seed2/c0", "tent/seed2/c1", "tent/seed2/c2", "cmf/seed2"]
  continual = units.plan("continual", (1,), ms, {1: segments("continual")})
  assert [u.key for u in continual] == ["tent/seed1", "cmf/seed1"]  # one model over the whole stream


class _Dev:
  def __init__(self, platform):
    self.platform = platform


def test_device_groups():
  cpus, gpus = [_Dev("cpu")] * 2, [_Dev("gpu")] * 8
  assert [len(g) for g in units.device_groups(cpus, None, 30)] == [2]  # a CPU: one group, batches split
  assert [len(g) for g in units.device_groups(gpus, None, 30)] == [1] * 8  # more units than GPUs: one each
  assert [len(g) for g in units.device_groups(gpus, None, 4)] == [8]
  assert [len(g) for g in units.device_groups(gpus, 3, 30)] == [3, 3]  # two devices left idle
  with pytest.raises(UserError, match=r"^--devices-per-unit: expected 1 to 2 \(the local devices\), got 3; on a "
                                     r"CPU host, --cpu-devices 3 splits the CPU into 3 devices$"):
    units.device_groups(cpus, 3, 30)
  with pytest.raises(UserError, match=r"^--devices-per-unit: expected 1 to 8 \(the local devices\), got 9$"):
    units.device_groups(gpus, 9, 30)  # a GPU host: no word of --cpu-devices


def test_claims_hand_each_unit_out_once_take_over_a_dead_workers_and_skip_finished_ones(tmp_path):
  plan = [units.Unit(f"tent/seed1/c{i}", "tent", 1, (i,), 8) for i in range(4)]
  resume = progress.Resume(str(tmp_path))
  resume.start(dict(config_key="k", data_key="d", units=[u.key for u in plan], source_keys={}))
  a = units.Claims(plan, resume, set(), shared=True, timeout_s=60)
  b = units.Claims(plan, resume, set(), shared=True, timeout_s=60)
  got_a, got_b = a.next(), b.next()
  assert (got_a.key, got_b.key) == ("tent/seed1/c0", "tent/seed1/c1")  # b skips a's live claim
  resume.save_unit(progress.UnitRecord("tent/seed1/c2", done=True))  # finished by a third worker
  assert b.next().key == "tent/seed1/c3" and b.next() is None
  # A claim of a process that is gone, on this host: taken over at once, not after the timeout.
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  path = os.path.join(a.dir, progress.unit_folder("tent/seed1/c0"))
  with open(path, "w") as f:
    json.dump(dict(worker="gone", host=os.uname().nodename, pid=dead.pid), f)
  c = units.Claims(plan, resume, set(), shared=True, timeout_s=60)
  assert c.next().key == "tent/seed1/c0"
  # Elsewhere, only a heartbeat older than the timeout gives a claim up.
  b.finish(got_b, done=False)
  path = os.path.join(a.dir, progress.unit_folder("tent/seed1/c1"))
  with open(path, "w") as f:
    json.dump(dict(worker="far", host="another-host", pid=1), f)
  assert c.next() is None
  old = time.time() - 120
  os.utime(path, (old, old))
  assert c.next().key == "tent/seed1/c1"
  assert a.workers_seen() == 1  # the three share this process: one worker registered
  for x in (a, b, c):
    x.close()


def cli(*args, timeout=900):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                        capture_output=True, text=True, timeout=timeout)


ARGS = ["--methods", "source,tent", "--corruptions", "fog,contrast", "--images", "64", "--batch-size", "16",
        "--save-predictions", "--no-progress", "--checkpoint-every", "1"]


def same_tables(a, b) -> None:
  """Two finished runs' records (but their timings), curves and predictions files, bit for bit."""
  ra, rb = (json.loads((d / "results.json").read_text()) for d in (a, b))
  strip = lambda res: [{k: v for k, v in r.items() if k != "seconds"} for r in res["records"]]
  assert strip(ra) == strip(rb) and len(strip(ra)) == 4
  assert ra["curves"] == rb["curves"]
  assert len(hf.same_predictions(a, b)) == 4


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
  """The reference: one process, one device, the units one after another."""
  out = tmp_path_factory.mktemp("units") / "sequential"
  r = cli(*ARGS, "--output", str(out))
  assert r.returncode == 0, r.stderr[-3000:]
  return out


@pytest.mark.slow
def test_two_units_at_once_on_two_devices_equal_one_after_another(sequential, tmp_path):
  out = tmp_path / "groups"
  r = cli(*ARGS, "--cpu-devices", "2", "--devices-per-unit", "1", "--output", str(out))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "group0: " in r.stdout and "group1: " in r.stdout  # both groups ran units
  same_tables(sequential, out)
  res = json.loads((out / "results.json").read_text())
  assert res["config"]["devices_per_unit"] == 1 and res["config"]["attention"] == "auto"
  assert res["kernels"] == dict(platform="cpu", attention="matmul", cpu_backward=True)  # what auto ran here


@pytest.mark.slow
def test_two_workers_on_one_output_equal_one_process(sequential, tmp_path):
  out = tmp_path / "workers"
  procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *ARGS, "--join",
                             "--expect-workers", "2", "--output", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  logs = [p.communicate(timeout=900) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in logs]
  ran = [sum(" started (" in line for line in o.splitlines()) for o, _ in logs]
  assert sum(ran) == 4 and min(ran) >= 1, ran  # each unit once, both workers busy
  assert sum("wrote " in o for o, _ in logs) == 1  # one worker wrote the table
  assert not any("alone" in o for o, _ in logs)
  same_tables(sequential, out)
  assert not (out / "resume").exists()


@pytest.mark.slow
def test_a_killed_worker_is_taken_over_and_the_table_is_the_same(sequential, tmp_path):
  out = tmp_path / "killed"
  args = [sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *ARGS, "--join", "--output", str(out)]
  p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while time.time() < deadline and not any(u["key"].startswith("tent") and u["batch"] >= 2
                                           for u in hf.open_units(out)):
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  held = os.listdir(out / "resume" / "claims")
  assert len(held) == 1  # the dead worker's claim stays behind
  r = subprocess.run(args, capture_output=True, text=True, timeout=900)  # a new worker, on this host
  assert r.returncode == 0, r.stderr[-3000:]
  same_tables(sequential, out)


def test_mismatched_workers_and_an_output_no_one_else_sees_are_refused(tmp_path):
  world = hf.make_world(tmp_path, CORR, classes=2, per_class=4)
  out = tmp_path / "o"
  cfg = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
             methods=("source", "tent"), seeds=(1,), batch_size=4, progress=False, join=True)
  # The first worker's manifest (`run_setup.setup` writes it and claims nothing), then workers started otherwise:
  # each refused in one line before it claims a unit.
  run_setup.setup(harness.RunConfig(**cfg), lambda *a: None).loader.close()
  other_ckpt = str(tmp_path / "other_ckpt")
  hf.make_checkpoint(other_ckpt, seed=7)
  one = sorted(glob.glob(str(world / "data" / "fog" / "5" / "*" / "*.JPEG")))[0]
  for change, what in ((dict(seeds=(2,)), r"its settings \(seeds\)"),
                       (dict(checkpoint=other_ckpt), r"the params of --checkpoint .*other_ckpt"),
                       ("an image less", r"its data \(images added, removed or relabelled\)")):
    if change == "an image less":  # the same --data as the first worker's, as this worker sees it
      os.rename(one, one + ".away")
      change = {}
    with pytest.raises(UserError, match=rf"progress.json: this worker differs from the others of this table in "
                                        rf"{what}; start every worker alike, or use another --output$"):
      harness.run(harness.RunConfig(**{**cfg, **change}), log=lambda *a: None)
  os.rename(one + ".away", one)
  assert not glob.glob(str(out / "resume" / "claims" / "*"))  # nothing claimed
  progress.Resume(str(out)).clear()
  lines = []
  res = harness.run(harness.RunConfig(**{**cfg, "methods": ("source",)}), log=lines.append)
  assert res["complete"] and not (out / "resume").exists()
  assert any("ran every unit of this table alone, no other worker registered" in line for line in lines)
  with pytest.raises(UserError, match=r"results.json holds a finished table of another configuration"):
    harness.run(harness.RunConfig(**cfg), log=lambda *a: None)
  again = harness.run(harness.RunConfig(**{**cfg, "methods": ("source",)}), log=lines.append)
  assert again["records"] == res["records"] and any("this table is complete" in line for line in lines)
  with pytest.raises(UserError, match=r"^--expect-workers 2: 1 worker\(s\) registered in .* within 1 s; is "
                                      r"--output a folder every worker shares\?$"):
    harness.run(harness.RunConfig(**{**cfg, "output": str(tmp_path / "alone"), "expect_workers": 2,
                                     "claim_timeout": 1.0}), log=lambda *a: None)


@pytest.mark.slow
def test_the_table_benchmark_runs_three_ways_and_finds_their_records_equal():
  r = subprocess.run([sys.executable, "-m", "benchmarks.table_parallel", "--methods", "source", "--images", "16",
                      "--corruptions", "fog,contrast", "--devices", "2"], cwd=ROOT, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line.endswith("x |")]
  assert len(rows) == 3 and rows[0].endswith("| 1.00x |"), r.stdout
  assert "equal (timings aside): True; the split way's equal them: True" in r.stdout, r.stdout
  bad = subprocess.run([sys.executable, "-m", "benchmarks.table_parallel", "--devices", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.strip().endswith("--devices and --images must be positive, got 0, "
                                                             "1280"), bad.stderr
