"""Ray, for ``--executor ray``: the module itself (`require_ray`, a one-line error without it, imported with the
settings a local or loopback cluster needs), the cluster's address checked before any work (`check_address`), the
connection (`connect`: a local instance whose every server listens on 127.0.0.1 only, or the cluster at
``--ray-address``; one line when neither answers within ``--ray-timeout``), what it exposes (`exposure`, the
run's log line), and the pool of actors a cluster has room for (`pool`). Imports nothing of pcsr_jax but
`errors`: `config` checks the flags with it; `ray_units` runs the table on it.

Where Ray binds (Ray 2.60, measured with ``ss -ltnp`` during a run and tested in ``tests/test_ray_units.py``):
its servers (the GCS, the raylet's node and object managers, each worker's and actor's core-worker server, the
runtime-env and metrics agents) listen on the node's IP address, and on every interface (``*``) when that IP is
not a loopback one. Ray turns ``127.0.0.1`` into the address of the interface that routes outside unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which it reads once, when ``ray`` is first imported, and which the
processes it starts inherit. So the variable is set before the import (`require_ray`) for a local instance and
for a loopback ``--ray-address``: every server then listens on 127.0.0.1. Ray 2.60 also turns on its token
authentication for a new local instance (the token in ``~/.ray/auth_token``) unless ``RAY_AUTH_MODE`` says
otherwise; the log line says which.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from pcsr_jax.errors import UserError, error_line

INSTALL = 'pip install -e ".[ray]" (or pip install "ray>=2.40")'
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as the node's address
# --ray-timeout's defaults: a local instance starting on a loaded 2-core machine took over 20 s (issue 76); an
# address that answers without a Ray cluster behind it makes ray.init retry for minutes.
START_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 60.0
# Ray's own waits while a local instance starts (environment variables its processes read), raised to the bound
# so that a slow start runs into ours, with its one line, rather than into one of Ray's. Ray waits for the GCS's
# port (and for the Python client's first connection) in C++ holding the GIL, when no thread of ours runs: those
# waits are the bound itself, so that their end is where ours is told. The others are never below a minute: the
# workers register with the raylet, and every process reconnects to the GCS, all along the run (a GCS client
# that gave up after 60 s ended a run on a loaded 2-core machine).
GCS_WAITS = ("RAY_gcs_server_port_wait_time_s", "RAY_py_gcs_connect_timeout_s")
RAY_START_WAITS = ("RAY_raylet_start_wait_time_s", "RAY_worker_register_timeout_seconds",
                   "RAY_gcs_rpc_server_connect_timeout_s")
SAY_EVERY_S = 15.0  # a local start still under way says so this often
RAYLET_REGISTER_S = 30  # ray/_private/node.py waits this long, not settable, for its raylet to register


def is_loopback(address: Optional[str]) -> bool:
  """Whether ``--ray-address`` names this machine's loopback (``127.x.x.x``, ``::1``, ``localhost``)."""
  if not address or address == "auto" or address.startswith("ray://"):
    return False
  host = address.rpartition(":")[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def require_ray(address: Optional[str] = None, local: bool = True, timeout_s: Optional[float] = None):
  """The ``ray`` module, or a one-line error saying how to install it. For a local instance (``local`` and no
  ``address``) or a loopback ``address``, Ray is first told to keep 127.0.0.1 as the node's address (before it
  is imported: it reads that once); for a local instance Ray's own start-up waits are raised to ``timeout_s``.
  Settings the user exported stay theirs, but for Ray's waits for the GCS, which are capped at ``timeout_s``."""
  if (local and address is None) or is_loopback(address):
    os.environ.setdefault(LOOPBACK_ENV, "0")
    if local and address is None:
      bound = math.ceil(timeout_s or START_TIMEOUT_S)
      # Ray's waits for the GCS hold the GIL: never longer than the bound, whatever the environment says (a
      # larger exported value, or one an earlier call in this process set, would hide --ray-timeout)
      for var in GCS_WAITS:
        os.environ[var] = str(min(_int_env(var, bound), bound))
      for var in RAY_START_WAITS:
        os.environ.setdefault(var, str(max(bound, 60)))
  try:
    import ray
  except ImportError:
    raise UserError(f"--executor ray: Ray is not installed; {INSTALL}") from None
  constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
  if constants is not None and os.environ.get(LOOPBACK_ENV) == "0":
    constants.ENABLE_RAY_CLUSTER = False  # ray was imported before (by a caller): what the import would have read
  return ray


def _int_env(var: str, default: int) -> int:
  """``int(os.environ[var])``, or ``default`` when it is unset or not a whole number."""
  try:
    return int(os.environ[var])
  except (KeyError, ValueError):
    return default


def connect(address: Optional[str], timeout_s: Optional[float] = None, log: Callable = print
            ) -> Callable[[], None]:
  """Connects to the cluster at ``address`` (None: starts a local instance on 127.0.0.1); returns what
  disconnects (and stops a local instance). An address that is malformed or closed is a one-line error at once.
  A start or connection still under way after ``timeout_s`` (``--ray-timeout``; default `START_TIMEOUT_S` for a
  local instance, `CONNECT_TIMEOUT_S` for an address) ends the command with one line and exit 2, the processes
  it started stopped (nothing has run yet: there is no work to lose); a slow local start says every
  `SAY_EVERY_S` that it is still starting."""
  ray = require_ray(address, timeout_s=timeout_s)
  local = address is None
  bound = float(timeout_s or (START_TIMEOUT_S if local else CONNECT_TIMEOUT_S))
  where = f"--ray-address {address}" if address else "--executor ray (a local Ray instance)"
  kw: dict[str, Any] = dict(log_to_driver=False, configure_logging=False)
  if local:
    # "local": a new instance of our own. With no address Ray joins the latest cluster started on this machine
    # (/tmp/ray/ray_current_cluster, or RAY_ADDRESS): someone else's, or a dead one that it waits 60 s for.
    kw.update(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
  else:
    check_address(address)
    kw.update(address=address)
  what = "did not start" if local else "no Ray cluster answered"
  line = f"{where}: {what} within {bound:g} s (--ray-timeout)"
  # Ray's core logs its retries to stderr while it connects: the command's own line says what went wrong.
  stderr = os.dup(2)
  quiet = os.open(os.devnull, os.O_WRONLY)
  os.dup2(quiet, 2)
  t0 = time.monotonic()
  done = threading.Event()
  watchdog = threading.Thread(target=_watch, args=(done, t0, bound, local, stderr, line, log), daemon=True)
  watchdog.start()
  try:
    while True:
      try:
        ray.init(**kw)  # in the main thread: a local instance started from another thread loses its GCS
        break
      except Exception as e:  # noqa: BLE001 -- one line, whatever Ray raised
        text = str(e).strip().splitlines()
        waited = time.monotonic() - t0
        if local and "timed out during startup" in str(e) and waited < bound - RAYLET_REGISTER_S:
          # Ray's own fixed 30 s wait for its raylet ran out (a loaded machine): start again within the bound
          ray.shutdown()
          log(f"{where}: Ray's raylet did not register within Ray's own {RAYLET_REGISTER_S} s; starting again "
              f"({bound - waited:.0f} s of --ray-timeout left)")
          continue
        if local:
          # the processes first: Ray's shutdown waits without a bound for some it started (valgrind's hook)
          _stop_children()
          ray.shutdown()
        if waited >= bound - 1:  # Ray's wait for its GCS (set to the bound) ended, or ours
          raise UserError(line) from None
        raise UserError(f"{where}: cannot connect ({type(e).__name__}{': ' + text[0] if text else ''})") from None
  finally:
    done.set()
    os.dup2(stderr, 2)
    os.close(stderr)
    os.close(quiet)
  return ray.shutdown


def _watch(done: threading.Event, t0: float, bound: float, local: bool, stderr: int, line: str, log) -> None:
  """The connection's watchdog: a line every `SAY_EVERY_S` while a local instance starts, and at ``bound`` the
  command's one line and exit 2 (as `cli.run_cli` ends on a `UserError`), the processes Ray started stopped
  first."""
  while not done.wait(min(SAY_EVERY_S, max(bound - (time.monotonic() - t0), 0.0))):
    waited = time.monotonic() - t0
    if waited >= bound:
      try:
        _stop_children()
        os.write(stderr, error_line(line).encode())
      finally:  # whatever failed above, the command ends at the bound
        os._exit(2)
    if local:
      try:
        log(f"--executor ray: the local Ray instance is still starting ({waited:.0f} s; the machine is busy?); "
            f"waiting up to --ray-timeout {bound:g} s")
      except Exception:  # noqa: BLE001 -- a line that cannot be written must not end the watchdog
        pass


def _stop_children() -> None:
  """Kills the processes this one started (a local instance's GCS, raylet and workers), so a start given up on
  leaves none behind."""
  try:
    import psutil  # a dependency of Ray's
  except ImportError:
    return
  try:
    children = psutil.Process().children(recursive=True)
  except psutil.Error:
    return
  for p in children:
    try:
      p.kill()
    except psutil.Error:
      pass


def exposure(address: Optional[str]) -> str:
  """What the connected Ray instance exposes, for the run's log: where a local instance's servers listen (the
  node's address, which decides it: see the module docstring) and whether Ray's token authentication is on."""
  import ray

  node_ip = ray.util.get_node_ip_address()
  auth = os.environ.get("RAY_AUTH_MODE", "disabled").lower() == "token"
  auth_text = ("token authentication on (the token in ~/.ray/auth_token or RAY_AUTH_TOKEN)" if auth else
               "token authentication off (RAY_AUTH_MODE; anyone who reaches a server can run code on it)")
  if address is None:
    if is_loopback(f"{node_ip}:0"):
      return (f"Ray: a local instance; its servers (GCS, raylet, object manager, workers, agents; no dashboard) "
              f"listen on {node_ip} only; {auth_text}")
    return (f"Ray: a local instance on node address {node_ip}: its servers listen on every interface "
            f"({LOOPBACK_ENV}={os.environ.get(LOOPBACK_ENV)!r} kept it off the loopback); {auth_text}")
  return (f"Ray: the cluster at {address} (this driver's node address {node_ip}); where its servers listen is "
          f"the cluster's own `ray start` setting; {auth_text}")


def check_address(address: str) -> None:
  """``HOST:PORT`` must parse and accept a TCP connection (``auto`` and ``ray://`` addresses are Ray's to
  resolve)."""
  if address == "auto" or address.startswith("ray://"):
    return
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UserError(f"--ray-address {address}: expected HOST:PORT of the cluster's head (its GCS, 6379 by "
                    f"default), auto, or ray://HOST:PORT")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
  except OSError as e:
    raise UserError(f"--ray-address {address}: no Ray cluster there ({e.strerror or type(e).__name__}); start "
                    f"one with `ray start --head`") from None


def pool(resources: dict, devices_per_unit: Optional[int], n_units: int) -> tuple[int, dict]:
  """``(actors, their resource options)``: one actor per ``devices_per_unit`` GPUs of the cluster (default 1),
  or on a cluster without GPUs per that many CPUs; no more actors than units."""
  per = devices_per_unit or 1
  if resources.get("GPU", 0) >= 1:
    n, opts, what = int(resources["GPU"] // per), dict(num_gpus=per, num_cpus=1), "GPU"
  else:
    n, opts, what = int(resources.get("CPU", 0) // per), dict(num_cpus=per), "CPU"
  if n < 1:
    raise UserError(f"--devices-per-unit {per}: the Ray cluster has {resources.get(what, 0):g} {what}s, fewer "
                    f"than one unit needs")
  return min(n, max(n_units, 1)), opts
