"""Multi-process runs with `jax.distributed`: start-up and the few host-side agreements the harness needs.

One process per host (or per accelerator) runs the same command; ``jax.distributed.initialize`` joins them, and
the engine's 1-D ``'data'`` mesh then spans every device of every process. The harness keeps the stream
identical to a one-process run (the same global batches, in the same order):

* each process decodes only its own rows of every global batch (`Adapter.local_rows`);
* per batch, the processes exchange which of their rows were readable and whether a stop (SIGINT/SIGTERM) was
  requested (`Exchange.allgather`), so all of them compact the batch the same way and stop at the same batch;
* process 0 alone writes outputs and the resume state; every process reads the saved progress on ``--resume``
  (the output folder must be on a filesystem shared by all hosts).

The exchanges go through the coordination service's key-value store, not a device collective: reading a device
collective's result would wait for the step already queued on the device, stalling the pipeline once per batch.
A process that dies (SIGKILL, a lost host) stops heart-beating; the coordination service then terminates the
others within ``heartbeat_timeout_s`` instead of leaving them blocked in a collective.

On CPU, jax 0.10 runs cross-process collectives with gloo by default once the distributed client exists
(``jax_cpu_collectives_implementation``), so nothing is set here for CPU runs.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Optional

import jax

from pcsr_jax.errors import UserError

# How long a process waits for the others at an exchange. Long on purpose: another process may legitimately be
# busy for a long time (compiling, computing source statistics); a dead one is caught by the heartbeat instead.
WAIT_S = 24 * 3600


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, auto: bool = False, heartbeat_timeout_s: int = 100) -> None:
  """Joins a multi-process run: explicit ``coordinator`` (``HOST:PORT`` of process 0), ``num_processes`` and
  ``process_id``, or ``auto`` (jax's detection of a TPU pod, SLURM or Open MPI job, or the
  ``JAX_COORDINATOR_ADDRESS`` environment). Does nothing when none is given. Must run before any JAX call."""
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
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id,
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
