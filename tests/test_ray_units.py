"""``--executor ray`` (`pcsr_jax.ray_units`) on local Ray clusters bound to 127.0.0.1 (`ray.cluster_utils`, every
node a set of processes on this machine; `conftest` keeps Ray on the loopback): a table on two nodes equals the
one-process run record for record and prediction for prediction; a node removed mid-unit, a driver killed and
rerun with ``--resume``, each still the same table with no unit recorded twice; a bad or dead ``--ray-address``
and a missing Ray are one line, exit 2, within seconds. Each test stops its cluster."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import harness_fixtures as hf
from pcsr_jax import harness
from pcsr_jax.errors import UserError
from test_units import ROOT, reference_run, same_tables

# 8 batches per unit, progress saved after each: a unit is under way long enough to lose its node or driver.
ARGS = ["--methods", "source,tent", "--corruptions", "fog,contrast", "--images", "128", "--batch-size", "16",
        "--save-predictions", "--no-progress", "--checkpoint-every", "1"]


def cli(*args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                        capture_output=True, text=True, timeout=timeout)


def start(*args):
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
  return reference_run(tmp_path_factory.mktemp("ray") / "sequential", ARGS)


@pytest.fixture
def cluster():
  """A head without CPUs (no actor runs there) on 127.0.0.1; the test adds the nodes that run units."""
  from ray.cluster_utils import Cluster  # the `ray` extra, as every test here; the core install has no Ray

  c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False))
  assert c.address.startswith("127.0.0.1:"), c.address
  try:
    yield c
  finally:
    c.shutdown()


def wait_under_way(out, proc, min_batch: int = 2, timeout: float = 300) -> None:
  """Until a unit of the run in ``out`` has saved its progress at ``min_batch`` or later, not finished."""
  deadline = time.time() + timeout
  while not any(u["batch"] >= min_batch for u in hf.open_units(out)):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline, "no unit under way"
    time.sleep(0.05)


def unit_lines(stdout: str) -> list[str]:
  return [line for line in stdout.splitlines() if re.match(r"^\w+/seed\d+ \w+: accuracy", line)]


@pytest.mark.slow
def test_a_table_on_two_ray_nodes_equals_one_process(sequential, cluster, tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # nodes (their actors) without the tests' cache: the run's own
  for _ in range(2):
    cluster.add_node(num_cpus=1)
  out = tmp_path / "ray"
  r = cli(*ARGS, "--executor", "ray", "--ray-address", cluster.address, "--output", str(out))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "2 actor(s) of {'num_cpus': 1} for 4 unit(s) left" in r.stdout
  hosts = set(re.findall(r"^(\S+ \(cpu x1\)): \S+ started", r.stdout, re.M))
  assert len(hosts) == 2, r.stdout  # both actors ran units
  assert len(unit_lines(r.stdout)) == 4 and "units 4 of 4 done" in r.stdout
  same_tables(sequential, out)
  assert not (out / "resume").exists() and os.listdir(out / "jax_cache")  # the actors' compiles, for a restart


@pytest.mark.slow
def test_a_node_removed_mid_unit_leaves_the_table_the_same(sequential, cluster, tmp_path):
  """One node runs the table's only actor; mid-unit a second node joins and the first is removed: Ray restarts
  the actor on the second, the driver hands the lost unit out again and it resumes from its saved progress."""
  first = cluster.add_node(num_cpus=1)
  out = tmp_path / "lost"
  p = start(*ARGS, "--executor", "ray", "--ray-address", cluster.address, "--output", str(out))
  try:
    wait_under_way(out, p)
    cluster.add_node(num_cpus=1)
    cluster.remove_node(first)
    stdout, stderr = p.communicate(timeout=600)
  finally:
    p.kill()
  assert p.returncode == 0, stderr[-3000:]
  lost = re.findall(r"^(\S+): its actor was lost \(\w+\); handed out again, from its saved progress$", stdout, re.M)
  assert len(lost) == 1, stdout
  assert len(unit_lines(stdout)) == 4 and sorted(set(unit_lines(stdout))) == sorted(unit_lines(stdout))
  assert sum(f"{lost[0]} started" in line for line in stdout.splitlines()) == 2  # on the lost actor, then again
  same_tables(sequential, out)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_or_stopped_driver_rerun_with_resume_finishes_the_same_table(sequential, cluster, tmp_path, how):
  """SIGKILL: the driver dies with its lock and (Ray: their owner is gone) its actors; SIGTERM: each actor saves
  its unit at its next batch and the run exits 130 saying so. Either way ``--resume`` finishes the same table."""
  cluster.add_node(num_cpus=1)
  out = tmp_path / how
  args = [*ARGS, "--executor", "ray", "--ray-address", cluster.address, "--output", str(out)]
  p = start(*args)
  try:
    wait_under_way(out, p)
    p.send_signal(getattr(signal, how))
    stdout, _ = p.communicate(timeout=300)
  finally:
    p.kill()
  if how == "SIGTERM":
    assert p.returncode == 130 and "SIGTERM: stopping" in stdout and "interrupted: progress saved to" in stdout
  r = cli(*args, "--resume")
  assert r.returncode == 0, r.stderr[-3000:]
  # SIGKILL leaves the unit under way at its last save; after SIGTERM its actor may have finished it first
  under_way = "1" if how == "SIGKILL" else "[01]"
  assert re.search(rf"resuming from .*: \d of 4 units done, {under_way} under way", r.stdout), r.stdout
  same_tables(sequential, out)


def test_a_second_plain_run_on_one_output_is_refused_in_one_line(tmp_path):
  """The first run holds --output (`lock.hold`, as `harness.run` takes it); a second command on it exits 2 with
  one line naming the holder, before any work."""
  from pcsr_jax import lock

  out = tmp_path / "busy"
  with lock.hold(str(out), "the first run"):
    (out / "log.txt").write_text("the first run's lines\n")
    t0 = time.perf_counter()
    r = cli("--methods", "source", "--images", "16", "--corruptions", "fog", "--output", str(out))
  assert r.returncode == 2, r.stderr[-2000:]
  assert re.fullmatch(rf"imagenet_c.py: error: --output {out}: in use by the run {socket.gethostname()}:"
                      rf"{os.getpid()} \(since [^)]*: the first run\); wait for it to end, or give another --output\n",
                      r.stderr), r.stderr
  assert not (out / "resume").exists() and time.perf_counter() - t0 < 120
  assert (out / "log.txt").read_text() == "the first run's lines\n"  # the second run wrote nothing there


@pytest.mark.slow
def test_a_bad_or_dead_ray_address_is_one_line_within_seconds(tmp_path):
  closed = socket.socket()
  closed.bind(("127.0.0.1", 0))
  port = closed.getsockname()[1]
  closed.close()  # nothing listens there now
  silent = socket.socket()  # a port that accepts connections with no Ray cluster behind it
  silent.bind(("127.0.0.1", 0))
  silent.listen(8)
  base = ["--methods", "source", "--images", "16", "--corruptions", "fog", "--executor", "ray", "--output",
          str(tmp_path / "o")]
  try:
    for address, line in ((f"127.0.0.1:{port}", rf"--ray-address 127.0.0.1:{port}: no Ray cluster there "
                                                r"\(Connection refused\); start one with `ray start --head`"),
                          ("head-without-port", r"--ray-address head-without-port: expected HOST:PORT of the "
                                                r"cluster's head \(its GCS, 6379 by default\), auto, or "
                                                r"ray://HOST:PORT"),
                          (f"127.0.0.1:{silent.getsockname()[1]}", rf"--ray-address 127.0.0.1:"
                                                                   rf"{silent.getsockname()[1]}: no Ray cluster "
                                                                   r"answered within 20 s")):
      t0 = time.perf_counter()
      r = cli(*base, "--ray-address", address, timeout=180)
      assert r.returncode == 2 and re.fullmatch(rf"imagenet_c.py: error: {line}\n", r.stderr), r.stderr[-2000:]
      assert time.perf_counter() - t0 < 90  # seconds (the JAX import and the 20 s watchdog), not a hang
  finally:
    silent.close()


def test_executor_ray_without_ray_installed_says_how_to_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where the package is not installed
  world = hf.make_world(tmp_path, ("fog",), classes=2, per_class=2)
  cfg = harness.RunConfig(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(tmp_path / "o"),
                          corruptions=("fog",), methods=("source",), seeds=(1,), executor="ray")
  with pytest.raises(UserError, match=r'^--executor ray: Ray is not installed; pip install -e "\.\[ray\]" \(or '
                                      r'pip install "ray>=2\.40"\)$'):
    cfg.validate()
