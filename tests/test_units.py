"""A table's units (`pcsr_jax.units`): the plan, the queue, the cost-weighted time left, the output folder's lock,
two units at once on a 2-device CPU equal to one process running them one after another, bit for bit, and a
Ray worker that sees another table than its driver refused in one line (the Ray runs: `test_ray_units.py`)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import harness, methods, run_setup, units
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


def test_the_queue_hands_each_unit_out_once_prefers_a_compiled_step_and_takes_units_back():
  plan = units.plan("normal", [1], {"tent": methods.get("tent"), "sar": methods.get("sar")},
                    {1: segments("normal", n=2)})
  q = units.Queue(plan, done={"tent/seed1/c0"})
  assert q.left() == 3
  first = q.next(prefer=("sar", 1))
  assert first.key == "sar/seed1/c0"  # the executor's compiled method first, over plan order
  second = q.next()
  assert second.key == "tent/seed1/c1"
  q.finish(second, done=False)  # its executor was lost: it goes out again
  assert q.next(prefer=("sar", 1)).key == "sar/seed1/c1" and q.next().key == "tent/seed1/c1" and q.next() is None
  q.finish(first, done=True)
  assert q.left() == 2


def test_declared_passes_weigh_a_method_by_its_cost():
  assert units.declared_passes(methods.get("source")) == 1  # 1F
  assert units.declared_passes(methods.get("sar")) == 6  # 2F+2B, a backward two forwards' work
  assert units.declared_passes(methods.get("memo")) == 65 + 2 * 64  # 65F+64B
  assert units.declared_passes(methods.get("cotta")) == 5  # 3F+1B (+32F when triggered): the bracket left out
  assert units.declared_passes(methods.get("dpcore")) == 4  # 2F+1B (known) / 52F+50B (new): the first
  assert units.declared_passes(methods.get("dda")) == 2 + 3 * 50  # 2F + 50 UNet F+B per image


def test_the_time_left_weighs_the_units_left_by_their_expected_cost():
  """Two Source units timed, MEMO units left: a MEMO unit costs its declared passes at Source's seconds per pass
  (193 times a Source unit), not its images; once a MEMO unit is timed, its own seconds per image count. The wall
  time counts from the first unit's start."""
  from pcsr_jax import runlog

  plan = [units.Unit(f"{m}/seed1/c{i}", m, 1, (i,), 100) for m in ("source", "memo") for i in range(3)]
  lines = []
  t = runlog.Units(plan, set(), lines.append, say_starts=False, passes={"source": 1.0, "memo": 193.0})
  assert t.time_left() is None  # nothing timed yet
  t.start(plan[0])
  t0 = time.monotonic()
  up = lambda seconds: type("Up", (), dict(seen=100, correct=50, total_seconds=seconds))
  t.finish(plan[0], up(1.0), "c0", [dict(num_samples=100, accuracy=0.5)])
  t.finish(plan[1], up(1.0), "c1", [dict(num_samples=100, accuracy=0.5)])
  # 10 s of wall time for 2 s of Source's cost: left 1 Source unit (1 s) + 3 MEMO units (3 x 193 s)
  assert t.time_left(now=t0 + 10) == pytest.approx(10 * (1.0 + 3 * 193.0) / 2.0)
  assert "units 2 of 6 done, about" in lines[-1]
  t.finish(plan[3], up(50.0), "c0", [])  # MEMO: 0.5 s/image
  # done: Source 2 s + MEMO 50 s of cost in the 20 s; left: 1 Source (1 s), 2 MEMO (100 s)
  assert t.time_left(now=t0 + 20) == pytest.approx(20 * (1.0 + 100.0) / 52.0)
  assert t.time_left(now=t0 - 5) == 0.0  # never negative


def test_the_time_left_is_never_hours_on_a_table_of_minutes():
  """A first Source unit of 64 images whose 5 s are mostly its step's compilation, fifteen MEMO units of 64 images
  left (MEMO measured at 1.5 img/s here: some 11 min), the executors started 60 s after the run: no time is told
  until a Source unit has run on a compiled step (5 s x 193 passes per 64 images over 15 units was 4 hours, and
  the start-up's 60 s weighed with them); then it is minutes, counted from the first unit's start."""
  from pcsr_jax import runlog

  plan = [units.Unit(f"source/seed1/c{i}", "source", 1, (i,), 64) for i in range(2)]
  plan += [units.Unit(f"memo/seed1/c{i}", "memo", 1, (i,), 64) for i in range(15)]
  lines = []
  t = runlog.Units(plan, set(), lines.append, say_starts=False, passes={"source": 1.0, "memo": 193.0})
  time.sleep(0.5)  # the executors' start-up: not a unit's cost
  t.start(plan[0])
  t0 = time.monotonic()
  up = lambda seconds: type("Up", (), dict(seen=64, correct=32, total_seconds=seconds))
  t.finish(plan[0], up(5.0), "c0", [dict(num_samples=64, accuracy=0.5)])
  assert t.time_left(now=t0 + 5) is None and lines[-1].endswith("units 1 of 17 done")
  t.finish(plan[1], up(0.04), "c1", [dict(num_samples=64, accuracy=0.5)])  # 1,600 img/s, compiled
  left = t.time_left(now=t0 + 5.04)
  assert left == pytest.approx(5.04 * 15 * 64 * 193 * (0.04 / 64) / 5.04, rel=0.01)  # 116 s: 15 MEMO units
  assert 60 < left < 600 and "units 2 of 17 done, about" in lines[-2]


def test_a_second_run_on_one_output_is_refused_naming_the_holder(tmp_path):
  """Another process's run on a held folder is refused in one line naming the holder; a block of the holding
  process takes it again (the built-in command around its run); once the holder is gone the folder is free."""
  from pcsr_jax import lock

  out = str(tmp_path / "o")
  other = [sys.executable, "-c", "import sys; from pcsr_jax import cli, lock; "
           "cli.run_cli(lambda a: lock.hold(sys.argv[1], 'second run').__enter__())", out]
  with lock.hold(out, "first run"):
    with lock.hold(out, "the same run, inside"):
      pass
    r = subprocess.run(other, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and re.fullmatch(
        rf"-c: error: --output {out}: in use by the run {os.uname().nodename}:{os.getpid()} \(since "
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d: first run\); wait for it to end, or give another --output\n",
        r.stderr), r.stderr
  r = subprocess.run(other, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr  # released when the first run ended (or died: flock goes with the process)


def test_an_actor_of_a_dead_or_replaced_driver_writes_nothing(tmp_path):
  """Fencing (`lock.Fence`): each hold of --output gets the next generation; a writer of generation 1 (a Ray
  actor of the first driver) saves progress while its driver holds the folder, is refused once the driver is
  dead (its process killed: the lock free), and once a second driver holds it (generation 2), and writes
  nothing then: neither the unit's record nor a new state."""
  from pcsr_jax import lock, progress

  out = str(tmp_path / "o")
  driver = subprocess.Popen([sys.executable, "-c", "import sys, time; from pcsr_jax import lock\n"
                             "with lock.hold(sys.argv[1], 'driver 1'):\n"
                             "  print(lock.generation(sys.argv[1]), flush=True)\n  time.sleep(600)", out],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert driver.stdout.readline().strip() == "1"
    resume = progress.Resume(out)
    resume.fence = lock.Fence(out, 1)
    rec = progress.UnitRecord("tent/seed1/fog", progress=progress.UnitProgress("tent/seed1/fog", batch=3))
    resume.save_unit(rec, {"w": np.ones(3, np.float32)})  # the driver holds --output: written
    unit_dir = resume.unit_dir(rec.key)
    saved = sorted(os.listdir(unit_dir))
    assert resume.load_unit(rec.key).progress.batch == 3 and len(saved) == 2  # unit.json and its state
  finally:
    driver.kill()
    driver.wait()
  rec.progress.batch = 4
  with pytest.raises(lock.Fenced, match=r"the driver of generation 1 no longer holds .* \(it died\)$"):
    resume.save_unit(rec, {"w": np.ones(3, np.float32)})
  with lock.hold(out, "driver 2"):
    gen = lock.generation(out)
    assert gen == 2 and json.loads((tmp_path / "o" / ".lock").read_text())["generation"] == 2
    with pytest.raises(lock.Fenced, match=r"is held by another run now \(generation 2, this actor's driver's 1\)$"):
      resume.save_unit(rec, {"w": np.ones(3, np.float32)})
    assert sorted(os.listdir(unit_dir)) == saved and resume.load_unit(rec.key).progress.batch == 3
    own = progress.Resume(out)
    own.fence = lock.Fence(out, gen)  # an actor of the second driver writes
    own.save_unit(rec, {"w": np.ones(3, np.float32)})
    assert own.load_unit(rec.key).progress.batch == 4


def test_a_lock_path_that_is_a_link_or_not_a_regular_file_is_refused_and_nothing_is_written_through_it(tmp_path):
  """``<output>/.lock`` a symbolic link (to a file, or dangling), a hard link, a folder or a FIFO: one line
  naming it, and the file a link points to keeps its bytes (a dangling link's target is not made). Garbage in a
  regular lock file is no obstacle: the run takes the lock and writes its holder over it."""
  from pcsr_jax import lock

  out = tmp_path / "o"
  out.mkdir()
  target = tmp_path / "precious.txt"
  target.write_text("the user's file")
  cases = {"a symbolic link": lambda p: os.symlink(target, p),
           "a dangling symbolic link": lambda p: os.symlink(tmp_path / "made_through_the_link", p),
           "a hard link": lambda p: os.link(target, p), "a folder": os.mkdir, "a FIFO": os.mkfifo}
  for what, make in cases.items():
    path = out / ".lock"
    make(path)
    with pytest.raises(UserError) as e:
      with lock.hold(str(out), "run"):
        pass
    assert str(e.value).startswith(f"--output {out}: ") and str(path) in str(e.value), (what, str(e.value))
    assert "\n" not in str(e.value)
    assert target.read_text() == "the user's file" and not (tmp_path / "made_through_the_link").exists(), what
    os.rmdir(path) if path.is_dir() and not path.is_symlink() else os.remove(path)
  (out / ".lock").write_bytes(b"\x00\xffnot json{")
  with lock.hold(str(out), "run"):
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
  (out / ".lock").write_bytes(b"[1, 2]")  # JSON, not a holder: a second run's refusal still reads in one line
  assert lock.holder(str(out)) == "another run (its holder file is unreadable)"


def test_a_linked_lock_file_ends_the_command_in_one_line(tmp_path):
  """The command as typed, on the built-in benchmark: exit 2, one line, the linked file untouched."""
  out = tmp_path / "o"
  out.mkdir()
  target = tmp_path / "precious.txt"
  target.write_text("the user's file")
  os.symlink(target, out / ".lock")
  r = cli("--methods", "source", "--corruptions", "fog", "--images", "64", "--output", str(out), timeout=300)
  assert r.returncode == 2 and r.stderr == (f"imagenet_c.py: error: --output {out}: its lock file {out}/.lock is a "
                                            f"symbolic link; the run writes its lock there and follows no link out "
                                            f"of --output: remove the link\n"), r.stderr[-3000:]
  assert target.read_text() == "the user's file" and sorted(os.listdir(out)) == [".lock"]


def test_eval_order_both_writes_no_folder_through_a_link(tmp_path):
  """``--eval-order both`` runs into ``<output>/eval_before`` and ``eval_after``: a link there is one line, before
  any work, and nothing (no lock, no log) is written where it points."""
  out, outside = tmp_path / "o", tmp_path / "outside"
  out.mkdir()
  outside.mkdir()
  os.symlink(outside, out / "eval_before")
  r = cli("--methods", "source", "--corruptions", "fog", "--images", "64", "--eval-order", "both", "--output",
          str(out), timeout=300)
  assert r.returncode == 2 and r.stderr.startswith(f"imagenet_c.py: error: --output {out}: {out}/eval_before is a "
                                                   f"symbolic link (to {outside}); the run writes there"), r.stderr
  assert len(r.stderr.splitlines()) == 1 and os.listdir(outside) == []


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


def reference_run(out, args) -> object:
  """The reference table: one process, one device, the units one after another; its output folder."""
  r = cli(*args, "--output", str(out))
  assert r.returncode == 0, r.stderr[-3000:]
  return out


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
  return reference_run(tmp_path_factory.mktemp("units") / "sequential", ARGS)


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


def test_a_worker_that_sees_other_settings_checkpoint_or_data_than_the_driver_is_refused(tmp_path):
  """A Ray actor sets up as a worker of the driver's table (`run_setup.setup(worker=True)`): a node with other
  settings, another checkpoint or other data than the driver's manifest says is refused in one line, before it
  runs a unit; so is a node that does not see the driver's --output."""
  world = hf.make_world(tmp_path, CORR, classes=2, per_class=4)
  out = tmp_path / "o"
  cfg = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
             methods=("source", "tent"), seeds=(1,), batch_size=4, progress=False, executor="ray")
  with pytest.raises(UserError, match=r"no progress of the driver in --output .*; put --output on a filesystem "
                                      r"every node of the cluster shares$"):
    run_setup.setup(harness.RunConfig(**cfg), lambda *a: None, worker=True)
  run_setup.setup(harness.RunConfig(**cfg), lambda *a: None).loader.close()  # the driver's manifest
  worker = run_setup.setup(harness.RunConfig(**cfg), lambda *a: None, worker=True)
  worker.loader.close()
  assert worker.done == set() and len(worker.groups) == 1
  other_ckpt = str(tmp_path / "other_ckpt")
  hf.make_checkpoint(other_ckpt, seed=7)
  one = sorted(glob.glob(str(world / "data" / "fog" / "5" / "*" / "*.JPEG")))[0]
  for change, what in ((dict(seeds=(2,)), r"its settings \(seeds\)"),
                       (dict(checkpoint=other_ckpt), r"the params of --checkpoint .*other_ckpt"),
                       ("an image less", r"its data \(images added, removed or relabelled\)")):
    if change == "an image less":  # the same --data as the driver's, as this node sees it
      os.rename(one, one + ".away")
      change = {}
    with pytest.raises(UserError, match=rf"progress.json: the worker {os.uname().nodename} differs from the driver "
                                        rf"of this table in {what}; give every node of the cluster the same "
                                        rf"checkpoint and data$"):
      run_setup.setup(harness.RunConfig(**{**cfg, **change}), lambda *a: None, worker=True)
  os.rename(one + ".away", one)


@pytest.mark.slow
def test_the_table_benchmark_runs_three_ways_and_finds_their_records_equal():
  r = subprocess.run([sys.executable, "-m", "benchmarks.table_parallel", "--methods", "source", "--images", "16",
                      "--corruptions", "fog,contrast", "--devices", "2"], cwd=ROOT, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line.endswith("x |")]
  assert len(rows) == 3 and rows[0].endswith("| 1.00x |"), r.stdout
  assert "Ray's ways equal (timings aside): True; the split way's equal them: True" in r.stdout, r.stdout
  bad = subprocess.run([sys.executable, "-m", "benchmarks.table_parallel", "--devices", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.strip().endswith("--devices and --images must be positive, got 0, "
                                                             "1280"), bad.stderr
