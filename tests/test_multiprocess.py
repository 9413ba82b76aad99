"""Multi-process runs (`jax.distributed`): 2 processes x 2 CPU devices must give exactly the run of 1 process x 4
devices (the same global batches, predictions and accuracies), write one set of outputs, and resume after one
process is killed. Each run is the real CLI in subprocesses, with the coordinator on a free localhost port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import distributed
from pcsr_jax.data import sources
from pcsr_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "imagenet_c.py")
TIMEOUT_S = 300  # per run; a healthy one takes well under a minute here
HEARTBEAT_S = 10  # a killed process stops the other within about this
# The built-in benchmark, small: 2 corruptions x 48 images in batches of 10 (padded to 12 over 4 devices, so each
# process holds 6 rows: 4 + 2 padding of a full batch on process 1, and a ragged last batch of 8).
BUILTIN = ["--images", "48", "--corruptions", "fog,contrast", "--methods", "source,tent", "--batch-size", "10",
           "--seeds", "1", "--method-args", '{"tent": {"lr": 0.2}}', "--checkpoint-every", "1",
           "--save-predictions", "--no-progress"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args: list, out, processes: int, log_dir) -> list[tuple[subprocess.Popen, str]]:
  """Starts the CLI as ``processes`` processes (2 devices each when several, else 4 devices), logs in files."""
  devices = 4 if processes == 1 else 2
  xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  port = free_port()
  procs = []
  for k in range(processes):
    flags = [] if processes == 1 else ["--coordinator", f"localhost:{port}", "--num-processes", str(processes),
                                       "--process-id", str(k), "--heartbeat-timeout", str(HEARTBEAT_S)]
    log = os.path.join(str(log_dir), f"{os.path.basename(str(out))}.p{k}.{time.time_ns()}.log")
    with open(log, "w") as f:
      procs.append((subprocess.Popen([sys.executable, SCRIPT, *args, "--output", str(out), *flags], env=env,
                                     stdout=f, stderr=subprocess.STDOUT), log))
  return procs


def tail(log: str, n: int = 3000) -> str:
  with open(log) as f:
    return f.read()[-n:]


def wait(procs, timeout: float = TIMEOUT_S) -> list[int]:
  """Return codes; every process is killed (and the test fails with the logs) if any runs past ``timeout``."""
  deadline = time.time() + timeout
  codes = []
  for p, log in procs:
    try:
      codes.append(p.wait(max(1.0, deadline - time.time())))
    except subprocess.TimeoutExpired:
      for q, _ in procs:
        q.kill()
        q.wait()
      pytest.fail(f"a run took over {timeout:.0f} s; logs:\n" + "\n".join(f"--- {l}\n{tail(l)}" for _, l in procs))
  return codes


def run(args, out, processes, log_dir) -> list[str]:
  """Runs to completion; returns each process's log. Fails the test with the logs on a non-zero exit."""
  procs = launch(args, out, processes, log_dir)
  codes = wait(procs)
  if any(codes):
    pytest.fail(f"exit codes {codes}; logs:\n" + "\n".join(f"--- {l}\n{tail(l)}" for _, l in procs))
  return [tail(log, 10 ** 6) for _, log in procs]


def assert_same_results(a, b) -> None:
  """Identical records (accuracy, counts, skipped) and identical per-image predictions."""
  ra = json.loads((a / "results.json").read_text())
  rb = json.loads((b / "results.json").read_text())
  key = lambda r: (r["method"], r["corruption"], r["seed"], r["accuracy"], r["num_samples"], r["num_skipped"])
  assert sorted(map(key, ra["records"])) == sorted(map(key, rb["records"]))
  assert sorted(ra["skipped"]) == sorted(rb["skipped"])
  assert hf.same_predictions(a, b)


@pytest.fixture(scope="module")
def builtin_runs(tmp_path_factory):
  """The built-in benchmark slice as 1 process x 4 devices and as 2 processes x 2 devices."""
  d = tmp_path_factory.mktemp("mp")
  args = BUILTIN + ["--cache-dir", str(d / "cache")]
  one = run(args, d / "one", 1, d)
  two = run(args, d / "two", 2, d)
  return d, args, one, two


@pytest.mark.slow
def test_two_processes_match_one_and_write_one_set_of_outputs(builtin_runs):
  d, _, _, (log0, log1) = builtin_runs
  assert_same_results(d / "one", d / "two")
  # Tent adapted (its predictions differ from the source model's somewhere), so the state was shared correctly.
  pred = lambda m, c: np.load(d / "two" / "predictions" / f"{m}_{c}_5_seed1.npz")["predictions"]
  differ = sum(int((pred("source", c) != pred("tent", c)).sum()) for c in ("fog", "contrast"))
  print(f"tent vs source: {differ} of 96 predictions differ")
  assert differ > 0
  # One set of outputs, the same files as the one-process run, nothing left behind by either process.
  # (an event file's name holds its time and process: compared by its run, one file each)
  name = lambda f: "events.out.tfevents" if f.startswith("events.out.tfevents.") else f
  listing = lambda p: sorted(os.path.relpath(os.path.join(r, name(f)), p) for r, _, fs in os.walk(p) for f in fs)
  assert listing(d / "two") == listing(d / "one")
  assert any(f.startswith("tensorboard/units/") for f in listing(d / "two"))
  assert "wrote " in log0 and "| tent |" in log0
  assert "wrote " not in log1 and "| tent |" not in log1 and "built-in benchmark" not in log1  # only 0 speaks
  assert json.loads((d / "two" / "results.json").read_text())["processes"] == 2


def wait_for(out, method: str, batch: int, procs) -> dict:
  """Until the saved progress is in ``method``'s stream at ``batch`` or later (after a periodic save); that unit's
  saved position."""
  deadline = time.time() + TIMEOUT_S
  while time.time() < deadline:
    for unit in hf.open_units(out):
      if unit["key"].startswith(method) and unit["batch"] >= batch:
        return unit
    if any(p.poll() is not None for p, _ in procs):
      wait(procs, timeout=10)
      pytest.fail("a process ended before the stop point; logs:\n" + "\n".join(tail(l) for _, l in procs))
    time.sleep(0.05)
  wait(procs, timeout=1)
  pytest.fail("the run never reached the stop point")


@pytest.mark.slow
def test_stop_on_one_process_and_resume_after_one_is_killed(builtin_runs, tmp_path):
  """SIGINT to one process: both save at the same batch and exit. Resumed, then SIGKILL of one process: the
  other exits within the heartbeat timeout instead of hanging. Resumed again: the uninterrupted results."""
  d, args, _, _ = builtin_runs
  out = tmp_path / "stopped"
  procs = launch(args, out, 2, tmp_path)
  wait_for(out, "source", 2, procs)
  procs[1][0].send_signal(signal.SIGINT)
  assert wait(procs) == [130, 130]
  assert "interrupted: progress saved" in tail(procs[0][1])
  stopped_at = max(hf.open_units(out), key=lambda u: u["batch"])
  procs = launch(args + ["--resume"], out, 2, tmp_path)
  wait_for(out, "tent", 2, procs)
  t_kill = time.time()
  procs[1][0].send_signal(signal.SIGKILL)
  codes = wait(procs, timeout=6 * HEARTBEAT_S)  # the survivor must not hang in a collective
  print(f"stopped at {stopped_at['key']} batch {stopped_at['batch']}; after SIGKILL of process 1, process 0 "
        f"exited with {codes[0]} in {time.time() - t_kill:.1f} s")
  assert "resuming from" in tail(procs[0][1], 10 ** 6)
  assert codes[0] != 0 and codes[1] == -signal.SIGKILL
  assert not (out / "results.json").exists()
  log0, _ = run(args + ["--resume"], out, 2, tmp_path)
  assert "resuming from" in log0
  assert_same_results(d / "two", out)
  assert not (out / "resume").exists()


@pytest.mark.slow
def test_unreadable_images_give_the_one_process_batches(tmp_path):
  """Unreadable images compact the batch across the processes' shares exactly as one process does."""
  world = hf.make_world(tmp_path / "world", ("gaussian_noise", "fog"), classes=4, per_class=5)
  wnids = sorted(os.listdir(world / "data" / "fog" / "5"))
  # File order (--no-shuffle), batches of 8 over 4 devices: rows 0-3 on process 0, 4-7 on process 1. Item 1
  # (process 0's share) is unreadable, so item 4 moves into process 0's rows; item 9 likewise in batch 2.
  names = sources.imagenet_c_source(str(world / "data"), "fog", 5).names
  assert names[1] == f"{wnids[0]}/ILSVRC2012_val_00000001.JPEG"
  assert names[9] == f"{wnids[1]}/ILSVRC2012_val_00000004.JPEG"
  for w, k in ((wnids[0], 1), (wnids[1], 4)):
    victim = world / "data" / "fog" / "5" / w / f"ILSVRC2012_val_{k:08d}.JPEG"
    victim.write_bytes(victim.read_bytes()[:40])
  args = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt"), "--corruptions", "gaussian_noise,fog",
          "--methods", "tent", "--seeds", "1", "--batch-size", "8", "--no-shuffle", "--save-predictions",
          "--no-progress"]
  run(args, tmp_path / "one", 1, tmp_path)
  run(args, tmp_path / "two", 2, tmp_path)
  assert_same_results(tmp_path / "one", tmp_path / "two")
  rec = json.loads((tmp_path / "two" / "results.json").read_text())
  fog = next(r for r in rec["records"] if r["corruption"] == "fog")
  assert fog["num_samples"] == 18 and fog["num_skipped"] == 2 and len(rec["skipped"]) == 2


def test_flags_must_come_together():
  with pytest.raises(UserError, match="go together"):
    distributed.initialize(coordinator="localhost:1")
  with pytest.raises(UserError, match="--process-id"):
    distributed.initialize("localhost:1", 2, 2)
  distributed.initialize()  # nothing asked: a one-process run, nothing started
  assert not distributed.is_multiprocess() and distributed.is_main()
  assert distributed.Exchange().allgather("x") == ["x"]


@pytest.mark.parametrize("address, why", [
    ("localhost", "expected HOST:PORT"), ("localhost:notaport", "a port from 1 to 65535"),
    ("localhost:0", "a port from 1 to 65535"), ("localhost:65536", "a port from 1 to 65535"),
    ("localhost:", "a port from 1 to 65535"), (":1234", "non-empty host"), ("::1:1234", "in brackets"),
    ("[::1]", r"expected \[IPV6\]:PORT"), ("[]:1234", r"expected \[IPV6\]:PORT"),
    ("localhost:١٢", "a port from 1 to 65535")])
def test_a_malformed_coordinator_address_is_one_line_before_jax(address, why):
  """jax takes the text after the last ':' as the port unchecked: no port is an IndexError, 'notaport' a
  segmentation fault. Every process checks the address first (process 1 here: no port is bound or probed)."""
  with pytest.raises(UserError, match=f"--coordinator '{re.escape(address)}': .*{why}"):
    distributed.initialize(address, 2, 1)


def test_coordinator_addresses_that_parse():
  assert distributed.parse_address("localhost:1234") == ("localhost", 1234)
  assert distributed.parse_address("10.0.0.2:65535") == ("10.0.0.2", 65535)
  assert distributed.parse_address("[::1]:1") == ("::1", 1)


def test_process_0_refuses_a_port_in_use():
  """A port in use ends jax's coordinator in a segmentation fault; here one line naming --coordinator."""
  with socket.socket() as s:
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    with pytest.raises(UserError, match=f"--coordinator 'localhost:{port}': process 0 cannot start"):
      distributed.initialize(f"localhost:{port}", 2, 0)


def test_an_unreachable_coordinator_is_one_line_within_the_timeout():
  """Nothing listens at the coordinator's port: jax waits its 300 s and aborts with a C++ stack dump; here
  process 1 gives up after --init-timeout with one line (the real CLI, exit 2)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  start = time.time()
  p = subprocess.run([sys.executable, SCRIPT, "--images", "8", "--methods", "source", "--output", "unused",
                      "--coordinator", f"localhost:{free_port()}", "--num-processes", "2", "--process-id", "1",
                      "--init-timeout", "2"], env=env, capture_output=True, text=True, timeout=120)
  took = time.time() - start
  assert p.returncode == 2, p.stderr[-2000:]
  assert "no coordinator answered within 2 s" in p.stderr and "--coordinator" in p.stderr
  assert len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
  assert took < 60
