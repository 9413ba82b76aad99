"""Multi-process runs with `jax.distributed`: start-up and the few host-side agreements the harness needs.

One process per host (or per accelerator) runs the same command; ``jax.distributed.initialize`` joins them, and
the engine's 1-D ``'data'`` mesh then spans every device of every process. The harness keeps the stream
identical to a one-process run (the same global batches, in the same order):

* each process decodes only its own rows of every global batch (`Adapter.local_rows`);
* per batch, the processes exchange which of their rows were readable and whether a stop (SIGINT/SIGTERM) was
  requested (`Exchange.allgather`), so all of them compact the batch the same way and stop at the same batch;
* process 0 alone writes outputs and the resume state; every process reads the saved progress on ``--resume``
  (the output folder must be on a filesystem shared by all hosts); `batches` is the harness's stream of batches
  under these rules.

The exchanges go through the coordination service's key-value store, not a device collective: reading a device
collective's result would wait for the step already queued on the device, stalling the pipeline once per batch.
A process that dies (SIGKILL, a lost host) stops heart-beating; the coordination service then terminates the
others within ``heartbeat_timeout_s`` instead of leaving them blocked in a collective.

On CPU, jax 0.10 runs cross-process collectives with gloo by default once the distributed client exists
(``jax_cpu_collectives_implementation``), so nothing is set here for CPU runs.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import socket
import sys
import time
from typing import Any, Iterator, Optional

import jax
import numpy as np

from pcsr_jax.errors import UserError

# How long a process waits for the others at an exchange. Long on purpose: another process may legitimately be
# busy for a long time (compiling, computing source statistics); a dead one is caught by the heartbeat instead.
WAIT_S = 24 * 3600


def parse_address(address: str) -> tuple[str, int]:
  """``(host, port)`` of a ``--coordinator`` address: ``HOST:PORT`` with a non-empty host and a port from 1 to
  65535, an IPv6 host in brackets (``[::1]:1234``). jax takes the text after the last ``:`` as the port without
  a check: no port is an IndexError, a port that is not a number a segmentation fault."""
  bad = lambda why: UserError(f"--coordinator '{address}': {why}")
  if address.startswith("["):
    host, sep, port = address[1:].partition("]:")
    if not sep or not host:
      raise bad("expected [IPV6]:PORT")
  else:
    host, sep, port = address.rpartition(":")
    if not sep:
      raise bad("expected HOST:PORT")
    if not host or ":" in host:
      raise bad("expected HOST:PORT (a non-empty host; an IPv6 address in brackets: [::1]:PORT)")
  if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
    raise bad(f"expected a port from 1 to 65535, got '{port}'")
  return host, int(port)


def check_port_free(address: str, port: int) -> None:
  """Process 0's coordinator binds ``[::]:PORT``; a port in use there ends jax in a segmentation fault."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, port))
      return
    except OSError as e:
      if family == socket.AF_INET6 and e.errno != errno.EADDRINUSE:  # no IPv6 on this host: try IPv4
        continue
      raise UserError(f"--coordinator '{address}': process 0 cannot start the coordinator on port {port} of this "
                      f"host ({e.strerror or e})") from None


def wait_for_coordinator(address: str, host: str, port: int, timeout_s: float) -> None:
  """Waits until something accepts connections at the coordinator's address (process 0 may start later), at most
  ``timeout_s``. jax itself would wait as long and then abort the process with a C++ stack dump."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        return
    except OSError as e:
      why = e.strerror or str(e) or type(e).__name__
      if isinstance(e, socket.gaierror):
        raise UserError(f"--coordinator '{address}': unknown host '{host}' ({why})") from None
    if time.monotonic() >= deadline:
      raise UserError(f"--coordinator '{address}': no coordinator answered within {timeout_s:g} s (--init-timeout; "
                      f"last: {why}): is process 0 running there?")
    time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, auto: bool = False, heartbeat_timeout_s: int = 100,
               init_timeout_s: int = 300) -> None:
  """Joins a multi-process run: explicit ``coordinator`` (``HOST:PORT`` of process 0), ``num_processes`` and
  ``process_id``, or ``auto`` (jax's detection of a TPU pod, SLURM or Open MPI job, or the
  ``JAX_COORDINATOR_ADDRESS`` environment). Does nothing when none is given. Must run before any JAX call.

  ``init_timeout_s`` bounds the start-up (jax's ``initialization_timeout``, 300 s by default). jax does not
  raise when it runs out: it aborts the process with a C++ stack dump, and a malformed address or a port in use
  crashes it. So the explicit form checks first, each failure one line naming ``--coordinator``: the address
  (`parse_address`), the port free on process 0 (`check_port_free`), and on the others that the coordinator
  accepts connections within the timeout (`wait_for_coordinator`). What is left to jax's abort: a coordinator
  that answers but whose other processes do not all join within the timeout (process 0 prints how long it
  waits)."""
  explicit = (coordinator, num_processes, process_id)
  if not auto and all(v is None for v in explicit):
    return
  if not auto and any(v is None for v in explicit):
    raise UserError("--coordinator, --num-processes and --process-id go together (or use --distributed to let "
                    "jax detect the cluster)")
  if num_processes is not None and (num_processes < 1 or not 0 <= process_id < num_processes):
    raise UserError(f"--process-id: expected 0 to {num_processes - 1} with --num-processes {num_processes}, "
                    f"got {process_id}")
  if heartbeat_timeout_s < 1:
    raise UserError(f"--heartbeat-timeout: expected a positive number of seconds, got {heartbeat_timeout_s}")
  if init_timeout_s < 1:
    raise UserError(f"--init-timeout: expected a positive number of seconds, got {init_timeout_s}")
  start = time.monotonic()
  if coordinator is not None:
    host, port = parse_address(coordinator)
    if process_id == 0:
      check_port_free(coordinator, port)
      print(f"process 0 of {num_processes}: waiting up to {init_timeout_s} s (--init-timeout) for the others to "
            f"join at {coordinator}", file=sys.stderr, flush=True)
    elif process_id is not None:
      wait_for_coordinator(coordinator, host, port, init_timeout_s)
  remaining = max(1, int(round(init_timeout_s - (time.monotonic() - start))))
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=remaining,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))
  except (ValueError, RuntimeError) as e:  # no cluster detected, a bad address, a backend already started
    raise UserError(f"jax.distributed.initialize failed: {str(e).splitlines()[0]}") from None


def is_main() -> bool:
  """Process 0: the one that logs and writes."""
  return jax.process_index() == 0


def is_multiprocess() -> bool:
  return jax.process_count() > 1


class Exchange:
  """All-gathers of short strings between the processes, through the coordination service's key-value store.

  Every process must create its exchanges and call `allgather` the same number of times, in the same order (the
  harness does so at the same points of the same stream everywhere); those counts name the keys, so several
  runs in one process (``--eval-order both``, a table script's runs) never read each other's values. One
  process alone is a no-op.
  """

  _created = itertools.count()

  def __init__(self):
    self.name, self.calls = f"pcsr_jax/{next(Exchange._created)}", 0

  def allgather(self, value: str) -> list[str]:
    """``value`` of every process, in process order."""
    if not is_multiprocess():
      return [value]
    # jax has no public host-side key-value API; orbax reads the same client this way.
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    me, n, call = jax.process_index(), jax.process_count(), self.calls
    self.calls += 1
    client.key_value_set(f"{self.name}/{call}/{me}", value)
    out = [value if p == me else client.blocking_key_value_get(f"{self.name}/{call}/{p}", WAIT_S * 1000)
           for p in range(n)]
    if call:  # every process has posted this call, so all have read the previous one: drop this process's key
      client.key_value_delete(f"{self.name}/{call - 1}/{me}")
    return out

  def barrier(self) -> None:
    self.allgather("")

  @contextlib.contextmanager
  def main_first(self) -> Iterator[None]:
    """Process 0 runs the block first (e.g. fills a cache), then the others (which then find it filled)."""
    if not is_main():
      self.barrier()
    yield
    if is_main():
      self.barrier()


def batches(setup: Any, adapter: Any, seg: Any, start_batch: int, stop: Any) -> Iterator[tuple]:
  """The harness's batches (`harness._batches`) over several processes, giving exactly the one-process batches.

  This process decodes the batch's items at its rows ``lo..hi`` (`Adapter.local_rows`). The processes then
  exchange which of those were readable and whether a stop was requested: every process learns the batch's
  readable items, compacts them as one process would (unreadable items dropped, the rest moved up, padding
  at the end), and places the images of its rows of the compacted batch. An image that moved into its rows from
  another process's share (after an unreadable one) is decoded here again; without unreadable images nothing
  moves. All processes stop after the same batch: the first whose exchange carries a stop request.
  """
  from pcsr_jax.data.loader import Batch

  loader, bs = setup.loader, setup.cfg.batch_size
  lo, hi = adapter.local_rows()
  blank = None  # (shape, dtype) of an image, for padding rows
  for k, local in enumerate(loader.batches(seg.source_ids, seg.indices, start_batch=start_batch, rows=(lo, hi))):
    s = (start_batch + k) * bs
    ids, idx = seg.source_ids[s:s + bs], seg.indices[s:s + bs]
    mine = np.zeros(hi - lo, bool)
    mine[local.positions - lo] = True
    shares = [json.loads(w) for w in setup.exchange.allgather(json.dumps(
        ["".join("1" if m else "0" for m in mine), bool(stop.requested)]))]
    readable = np.asarray([c == "1" for bits, _ in shares for c in bits], bool)[:len(idx)]
    stop_now = any(flag for _, flag in shares)
    ok = np.flatnonzero(readable)
    srcs = [setup.srcs[int(i)] for i in ids]
    batch = Batch(images=np.zeros((0,)), labels=np.asarray([srcs[j].labels[idx[j]] for j in ok], np.int32),
                  names=[srcs[j].names[idx[j]] for j in ok], tags=np.asarray(ids[ok], np.int32),
                  skipped=[srcs[j].names[idx[j]] for j in np.flatnonzero(~readable)], positions=ok)
    if not len(ok):
      yield batch, None, stop_now
      continue
    decoded = dict(zip(local.positions.tolist(), local.images))
    rows = []
    for j in ok[lo:hi].tolist():
      x = decoded[j] if j in decoded else loader.decode(int(ids[j]), int(idx[j]))
      if x is None:
        raise UserError(f"{seg.name}/{srcs[j].names[idx[j]]}: read by one process, unreadable by another")
      rows.append(x)
    if blank is None:
      x = rows[0] if rows else loader.decode(int(ids[ok[0]]), int(idx[ok[0]]))
      blank = (x.shape, x.dtype)
    images = np.zeros((hi - lo,) + blank[0], blank[1])
    if rows:
      images[:len(rows)] = np.stack(rows)
    valid = np.arange(lo, hi) < len(ok)
    yield batch, adapter.place_local(images, valid), stop_now
