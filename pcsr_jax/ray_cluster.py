"""Ray, for ``--executor ray``: the module itself (`require_ray`, a one-line error without it), the cluster's
address checked before any work (`check_address`), the connection (`connect`: a local instance bound to
127.0.0.1, or the cluster at ``--ray-address``, in one line within seconds when there is none), and the pool of
actors a cluster has room for (`pool`). Imports nothing of pcsr_jax but `errors`: `config` checks the flags with
it; `ray_units` runs the table on it."""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable, Optional

from pcsr_jax.errors import UserError

INSTALL = 'pip install -e ".[ray]" (or pip install "ray>=2.40")'
CONNECT_TIMEOUT_S = 20.0  # ray.init on an address that answers but holds no Ray cluster would retry for minutes


def require_ray():
  """The ``ray`` module, or a one-line error saying how to install it."""
  try:
    import ray
  except ImportError:
    raise UserError(f"--executor ray: Ray is not installed; {INSTALL}") from None
  return ray


def connect(address: Optional[str]) -> Callable[[], None]:
  """Connects to the cluster at ``address`` (None: starts a local instance bound to 127.0.0.1); returns what
  disconnects (and stops a local instance). An address that is malformed or closed is a one-line error at once;
  one that answers without a Ray cluster behind it (``ray.init`` would retry for minutes) ends the command with a
  one-line error after `CONNECT_TIMEOUT_S` (nothing has run yet: there is no work to lose)."""
  if address is None:
    # Ray takes a local node's address from the interface that routes outside, unless told it runs alone: a
    # local instance then talks over 127.0.0.1 only. Read when Ray is imported, and by the processes it starts.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
  ray = require_ray()
  where = f"--ray-address {address}" if address else "--executor ray (a local Ray instance)"
  kw: dict[str, Any] = dict(log_to_driver=False, configure_logging=False)
  if address is None:
    kw.update(_node_ip_address="127.0.0.1", include_dashboard=False)
  else:
    check_address(address)
    kw.update(address=address)
  # Ray's core logs its retries to stderr while it connects: the command's own line says what went wrong.
  stderr = os.dup(2)
  quiet = os.open(os.devnull, os.O_WRONLY)
  os.dup2(quiet, 2)
  watchdog = threading.Timer(CONNECT_TIMEOUT_S, _give_up, (stderr, f"{where}: no Ray cluster answered within "
                                                                  f"{CONNECT_TIMEOUT_S:.0f} s"))
  watchdog.daemon = True
  watchdog.start()
  try:
    ray.init(**kw)  # in the main thread: a local instance started from another thread loses its GCS
  except Exception as e:  # noqa: BLE001 -- one line, whatever Ray raised
    text = str(e).strip().splitlines()
    raise UserError(f"{where}: cannot connect ({type(e).__name__}{': ' + text[0] if text else ''})") from None
  finally:
    watchdog.cancel()
    os.dup2(stderr, 2)
    os.close(stderr)
    os.close(quiet)
  return ray.shutdown


def _give_up(stderr: int, line: str) -> None:
  """The connection watchdog: the command's one line and exit 2, as `cli.run_cli` ends on a `UserError`."""
  prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "pcsr_jax"
  os.write(stderr, f"{prog}: error: {line}\n".encode())
  os._exit(2)


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
