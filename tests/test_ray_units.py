"""``--executor ray`` (`pcsr_jax.ray_units`) on local Ray clusters bound to 127.0.0.1 (`ray.cluster_utils`, every
node a set of processes on this machine; `conftest` keeps the test process's own Ray on the loopback): a table on
two nodes equals the one-process run record for record and prediction for prediction; a node removed mid-unit, a
driver stopped or killed and rerun with ``--resume`` (at once: its actors are fenced), a resume on the other
executor, each still the same table with no unit recorded twice; a local instance that listens on 127.0.0.1 only,
waits out a slow start and ends a stuck one in one line; a bad or dead ``--ray-address`` and a missing Ray are one
line, exit 2, within seconds. The commands run as a user runs them: without conftest's
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (`user_env`). Each test stops its cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import harness_fixtures as hf
from pcsr_jax import harness
from pcsr_jax.errors import UserError
from test_units import ROOT, reference_run, same_tables

# 8 batches per unit, progress saved after each: a unit is under way long enough to lose its node or driver.
ARGS = ["--methods", "source,tent", "--corruptions", "fog,contrast", "--images", "128", "--batch-size", "16",
        "--save-predictions", "--no-progress", "--checkpoint-every", "1"]


def user_env() -> dict:
  """The environment a user runs the command in: without the variable `conftest` exports for this process, nor
  those `ray_cluster.require_ray` set when a test of this process called it."""
  from pcsr_jax import ray_cluster as rc

  ours = {rc.LOOPBACK_ENV, *rc.GCS_WAITS, *rc.RAY_START_WAITS}
  return {k: v for k, v in os.environ.items() if k not in ours}


def cli(*args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                        capture_output=True, text=True, timeout=timeout, env=user_env())


def start(*args, **env):
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(user_env(), **env))


def stop(p: subprocess.Popen) -> None:
  """Ends ``p`` if it still runs, reaped and its pipes closed (no process or file left to a later test)."""
  if p.poll() is None:
    p.kill()
  p.communicate()


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
  costs = json.loads((out / "results.json").read_text())["costs"]  # measured by the actors, recorded by the driver
  assert set(costs) == {"source", "tent"} and all(c["step_s_median"] > 0 for c in costs.values()), costs


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
    stop(p)
  assert p.returncode == 0, stderr[-3000:]
  lost = re.findall(r"^(\S+): its actor was lost \(\w+\); handed out again, from its saved progress$", stdout, re.M)
  assert len(lost) == 1, stdout
  assert len(unit_lines(stdout)) == 4 and sorted(set(unit_lines(stdout))) == sorted(unit_lines(stdout))
  assert sum(f"{lost[0]} started" in line for line in stdout.splitlines()) == 2  # on the lost actor, then again
  same_tables(sequential, out)


def under_way_on_one_node(cluster, out) -> tuple[list, subprocess.Popen]:
  """The table's command on a node of one CPU added to ``cluster`` (its args and process), once a unit is under
  way; the caller stops it."""
  cluster.add_node(num_cpus=1)
  args = [*ARGS, "--executor", "ray", "--ray-address", cluster.address, "--output", str(out)]
  p = start(*args)
  try:
    wait_under_way(out, p)
  except BaseException:
    stop(p)
    raise
  return args, p


@pytest.mark.slow
def test_a_stopped_driver_rerun_with_resume_finishes_the_same_table(sequential, cluster, tmp_path):
  """SIGTERM: each actor saves its unit at its next batch and the run exits 130 saying so; ``--resume`` finishes
  the same table (a killed driver: `test_a_killed_drivers_actors_write_nothing_after_its_death`)."""
  out = tmp_path / "stopped"
  args, p = under_way_on_one_node(cluster, out)
  try:
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=300)
  finally:
    stop(p)
  assert p.returncode == 130 and "SIGTERM: stopping" in stdout and "interrupted: progress saved to" in stdout
  r = cli(*args, "--resume")
  assert r.returncode == 0, r.stderr[-3000:]
  # its actor may have finished the unit under way before it saw the stop
  assert re.search(r"resuming from .*: \d of 4 units done, [01] under way", r.stdout), r.stdout
  same_tables(sequential, out)


def unit_files(out) -> dict:
  """``{unit.json path: (mtime_ns, contents)}`` of a run's saved units."""
  found = {}
  for d in (out / "resume" / "units").glob("*"):
    try:
      found[str(d / "unit.json")] = ((d / "unit.json").stat().st_mtime_ns, (d / "unit.json").read_bytes())
    except OSError:
      pass
  return found


def lock_generation(out):
  try:
    return json.loads((out / ".lock").read_text()).get("generation")
  except (OSError, ValueError):
    return None


@pytest.mark.slow
def test_a_killed_drivers_actors_write_nothing_after_its_death(sequential, cluster, tmp_path):
  """A driver SIGKILLed mid-unit and a second started at once with ``--resume`` on the same cluster: from the
  first one's death until the second holds --output, no unit's progress changes (its actors, which Ray kills
  only later, are fenced: `lock.Fence`); the second holds the next generation; the table equals an
  uninterrupted run's."""
  out = tmp_path / "killed"
  args, p = under_way_on_one_node(cluster, out)
  second = None
  try:
    assert lock_generation(out) == 1
    p.kill()
    p.wait()
    before = unit_files(out)
    second = start(*args, "--resume")
    changed = []
    while lock_generation(out) != 2:  # until the second driver holds the folder
      assert second.poll() is None, second.communicate()[1][-3000:]
      now = unit_files(out)
      changed += [path for path in now if now[path] != before.get(path)]
      time.sleep(0.01)
    stdout, stderr = second.communicate(timeout=600)
  finally:
    stop(p)
    if second is not None:
      stop(second)
  assert not changed, f"written after the driver's death: {sorted(set(changed))}"
  assert second.returncode == 0, stderr[-3000:]
  assert re.search(r"resuming from .*: \d of 4 units done, 1 under way", stdout), stdout
  same_tables(sequential, out)


def listening(pid: int) -> list[tuple[str, str, int]]:
  """``(process name, address, port)`` of every listening TCP socket and bound UDP socket of ``pid`` and its
  descendants."""
  import psutil  # Ray's dependency

  root = psutil.Process(pid)
  found = []
  for proc in [root] + root.children(recursive=True):
    try:
      conns, name = proc.net_connections(kind="inet"), proc.name()
    except psutil.Error:  # ended meanwhile
      continue
    found += [(name, c.laddr.ip, c.laddr.port) for c in conns
              if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)]
  return found


def is_loopback(ip: str) -> bool:
  a = ipaddress.ip_address(ip.split("%")[0])
  return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


@pytest.mark.slow
def test_a_local_instance_listens_on_the_loopback_only_and_says_so(tmp_path):
  """Without --ray-address the command starts a local instance of its own: every server of it (GCS, raylet,
  workers, actors, agents) listens on a loopback address, with no variable set by the user; the log says so and
  that Ray's token authentication is on. A cluster Ray would otherwise join by itself (``RAY_ADDRESS``, or the
  latest one started on the machine: here a dead address, which Ray waited 60 s for and then ended the run) is
  not joined."""
  assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in user_env()
  out = tmp_path / "local"
  closed = socket.socket()
  closed.bind(("127.0.0.1", 0))
  dead = f"127.0.0.1:{closed.getsockname()[1]}"
  closed.close()
  p = start(*ARGS, "--executor", "ray", "--output", str(out), RAY_ADDRESS=dead)
  try:
    wait_under_way(out, p, min_batch=1)
    sockets = listening(p.pid)
    stdout, stderr = p.communicate(timeout=600)
  finally:
    stop(p)
  assert p.returncode == 0, stderr[-3000:]
  names = {name for name, _, _ in sockets}
  assert {"gcs_server", "raylet", "ray::UnitRunner"} <= names, sockets  # the run's Ray processes were seen
  assert all(is_loopback(ip) for _, ip, _ in sockets), [s for s in sockets if not is_loopback(s[1])]
  assert ("Ray: a local instance; its servers (GCS, raylet, object manager, workers, agents; no dashboard) "
          "listen on 127.0.0.1 only; token authentication on") in stdout


# Ray's own debugging hook (``RAY_GCS_SERVER_VALGRIND=1``) starts the GCS as ``valgrind OPTIONS... gcs_server
# ARGS...``: this ``valgrind`` on the PATH starts it after $GCS_DELAY seconds instead, or never ("stuck": it stops
# itself), whatever the machine's load: a slow or stuck start of the local instance on demand.
SLOW_GCS = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
if [ "$GCS_DELAY" = stuck ]; then kill -STOP $$; fi
sleep "$GCS_DELAY"
exec "$@"
"""


@pytest.mark.slow
def test_a_slow_local_start_is_waited_for_and_a_stuck_one_ends_in_one_line(tmp_path):
  """The local instance's GCS starting 25 s late (a loaded machine; longer than the 20 s the connection once
  allowed): the run says it is still starting and finishes. A GCS that never starts under ``--ray-timeout 5``:
  one line naming the flag, exit 2, and none of the processes it started left."""
  import psutil

  hook = tmp_path / "bin"
  hook.mkdir()
  (hook / "valgrind").write_text(SLOW_GCS)
  (hook / "valgrind").chmod(0o755)
  args = [sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), "--methods", "source",
          "--corruptions", "fog", "--images", "32", "--batch-size", "16", "--no-progress", "--executor", "ray"]
  env = dict(user_env(), PATH=f"{hook}:{os.environ['PATH']}", RAY_GCS_SERVER_VALGRIND="1", GCS_DELAY="25")
  r = subprocess.run([*args, "--output", str(tmp_path / "slow")], capture_output=True, text=True, timeout=600,
                     env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  # (said once the GIL is free: Ray waits for the GCS's port holding it)
  assert re.search(r"the local Ray instance is still starting \(\d+ s; the machine is busy\?\); waiting up to "
                   r"--ray-timeout 300 s", r.stdout), r.stdout
  assert "source/seed2022 fog: accuracy" in r.stdout
  p = subprocess.Popen([*args, "--ray-timeout", "5", "--output", str(tmp_path / "stuck")], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=dict(env, GCS_DELAY="stuck"))
  try:
    gcs = children_named(p.pid, "valgrind")
    t0 = time.perf_counter()
    try:
      _, stderr = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
      raise AssertionError(f"still running after 180 s: {process_tree(p.pid)}") from None
  finally:
    stop(p)
  assert p.returncode == 2 and stderr == ("imagenet_c.py: error: --executor ray (a local Ray instance): did not "
                                          "start within 5 s (--ray-timeout)\n"), stderr[-3000:]
  assert time.perf_counter() - t0 < 60
  assert not gcs.is_running() or gcs.status() == psutil.STATUS_ZOMBIE


def test_rays_waits_for_the_gcs_never_outlast_the_bound(monkeypatch):
  """Ray waits for its GCS holding the GIL, when the watchdog cannot run: those waits are capped at
  ``--ray-timeout`` whether the user exported a longer one or an earlier call in the process set it (CI's stuck
  start once waited 300 s for a GCS that never came: a test before it had called `require_ray` in the same
  process, with the default bound). Ray's other waits keep the user's values."""
  from pcsr_jax import ray_cluster as rc

  for var in (*rc.GCS_WAITS, *rc.RAY_START_WAITS):
    monkeypatch.delenv(var, raising=False)
  rc.require_ray(timeout_s=None)
  assert os.environ["RAY_gcs_server_port_wait_time_s"] == "300" and os.environ["RAY_raylet_start_wait_time_s"] == "300"
  rc.require_ray(timeout_s=5)
  assert all(os.environ[v] == "5" for v in rc.GCS_WAITS)
  assert os.environ["RAY_gcs_rpc_server_connect_timeout_s"] == "300"  # the first call's: reconnections may wait
  monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "1000")
  monkeypatch.setenv("RAY_raylet_start_wait_time_s", "1000")
  rc.require_ray(timeout_s=20)
  assert os.environ["RAY_gcs_server_port_wait_time_s"] == "20"
  assert os.environ["RAY_raylet_start_wait_time_s"] == "1000"  # not a wait for the GCS: the user's
  monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "3")
  rc.require_ray(timeout_s=20)
  assert os.environ["RAY_gcs_server_port_wait_time_s"] == "3"  # shorter than the bound: the user's


def process_tree(pid: int) -> str:
  """What ``pid`` and its descendants are doing (state, where each thread waits in the kernel), for a test that
  fails on a process that never ended."""
  import psutil

  lines = []
  try:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
  except psutil.Error:
    return f"{pid} gone"
  for q in procs:
    try:
      waits = sorted({open(f"/proc/{q.pid}/task/{t.id}/wchan").read() for t in q.threads()})
      lines.append(f"{q.pid} {q.name()} {q.status()} waits in {waits}: {' '.join(q.cmdline())[:120]}")
    except (psutil.Error, OSError):
      pass
  return "; ".join(lines)


def children_named(pid: int, name: str, timeout: float = 120):
  """The first descendant of ``pid`` called ``name``, once it exists."""
  import psutil

  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      found = [c for c in psutil.Process(pid).children(recursive=True) if c.name() == name]
    except psutil.Error:
      found = []
    if found:
      return found[0]
    time.sleep(0.05)
  raise AssertionError(f"no {name} under {pid}")


@pytest.mark.slow
def test_a_resume_may_switch_between_the_threads_and_ray(sequential, tmp_path):
  """A run stopped mid-unit under one executor continues under the other with ``--resume`` (the device groups
  are how a run runs, not part of what it computes: `progress.HOW_IT_RUNS`): threads then a local Ray instance,
  and Ray then threads, each the same table as an uninterrupted run."""
  for first, then in ((["--executor", "threads"], ["--executor", "ray"]),
                      (["--executor", "ray"], ["--executor", "threads"])):
    out = tmp_path / first[1]
    p = start(*ARGS, *first, "--output", str(out))
    try:
      wait_under_way(out, p)
      p.send_signal(signal.SIGTERM)
      stdout, stderr = p.communicate(timeout=300)
    finally:
      stop(p)
    assert p.returncode == 130, stderr[-3000:]
    r = cli(*ARGS, *then, "--output", str(out), "--resume")
    assert r.returncode == 0, (first, r.stderr[-3000:])
    assert re.search(r"resuming from .*: \d of 4 units done, [12] under way", r.stdout), r.stdout  # Ray: 2 actors
    assert "continuing on" not in r.stdout  # one device per unit both ways
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
                                                                   r"answered within 5 s \(--ray-timeout\)")):
      t0 = time.perf_counter()
      r = cli(*base, "--ray-address", address, "--ray-timeout", "5", timeout=180)
      assert r.returncode == 2 and re.fullmatch(rf"imagenet_c.py: error: {line}\n", r.stderr), r.stderr[-2000:]
      assert time.perf_counter() - t0 < 90  # seconds (the JAX import and the 5 s bound), not a hang
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
