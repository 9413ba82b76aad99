"""A table's units on a Ray cluster (``--executor ray``): Ray schedules and restarts, we only hand out units.

The driver (the process that ran the command) plans the units as every run does (`units.plan`), holds the output
folder's lock, and writes results.json, the table and the plots. Ray runs a pool of actors, one per device group
(``num_gpus`` = ``--devices-per-unit``, default 1, on a cluster with GPUs; ``num_cpus`` = that many on a
CPU-only one). Each actor sets up once (the checkpoint, the data, the driver's saved progress checked against its
own view: `run_setup.setup` as a worker) and runs the units the driver hands it one after another, keeping the
adapter of its last method and seed, so a method's step is compiled once per actor; the driver hands an actor
the units it can reuse its step for first. JAX's persistent compilation cache lives in ``<output>/jax_cache`` (or
where ``JAX_COMPILATION_CACHE_DIR`` says), so an actor Ray restarts and a later run load their compiles instead of
redoing them.

Faults are Ray's to handle: an actor whose process dies is restarted by Ray (``max_restarts=-1``), on its node
or, when the node is gone, on another with room; the unit it was running is handed out again to the next free
actor and resumes from its saved progress (every ``--checkpoint-every`` batches, `progress.Resume`), so no unit
is recorded twice. A driver that dies takes its actors with it (Ray kills them, though not at once); rerun the
command with ``--resume``: finished units are skipped, started ones resume. Until Ray has killed them, the writes
of a dead driver's actors are fenced (`lock.Fence`): each carries its driver's generation of the output's lock
and checks it before each write of progress, so an actor whose driver died, or whose folder another run holds
now, drops its unit with a line (in its Ray worker log) and exits, having written nothing after the check.
Ctrl-C or SIGTERM asks every actor to save its unit at its next batch.

``--output`` (and ``--data``, the checkpoint) must be on a filesystem every node shares, at the same path, as for
any multi-host run. ``--ray-address`` names a running cluster (``HOST:PORT`` of its head, or ``auto``); without
it the driver starts a local Ray instance, every server of which listens on 127.0.0.1 (`ray_cluster`), and stops
it at the end.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import sys
import time
from typing import Any, Callable, Optional

from pcsr_jax import lock, ray_cluster, runlog, units
from pcsr_jax.errors import UserError

MAX_LOSSES = 3  # a unit whose actor died this many times stops the run (it is what kills them)
NO_ACTOR_S = 600.0  # with units left and no actor up or running, give up after this long
CACHE = "jax_cache"


class UnitRunner:
  """A Ray actor's work: set up once (`start`), then run units by key (`run`), each from its saved progress; a
  second thread of the actor takes `request_stop`."""

  def __init__(self, cfg: Any, extra_methods: dict, paths: list, run_unit: Callable, make_adapter: Callable,
               probe_once: Callable, fence: Optional[lock.Fence] = None):
    for p in paths:  # where the driver found the --methods module:Class files
      if p not in sys.path:
        sys.path.append(p)
    self.cfg, self.extra_methods = cfg, extra_methods
    # `harness`'s, passed in: no import circle
    self.run_unit, self.make_adapter, self.probe_once = run_unit, make_adapter, probe_once
    self.setup: Any = None
    self.stop = _ActorStop()
    self.adapter: Any = None
    self.last: Optional[tuple] = None
    self.where = f"{socket.gethostname()}:{os.getpid()}"
    self.fence = fence  # the driver's hold on --output, checked before each write of progress

  def start(self) -> str:
    """Sets up (idempotent); returns where this actor runs."""
    if self.setup is None:
      import jax

      from pcsr_jax import methods, run_setup

      if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # a cache the user set up stays theirs
        jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.abspath(self.cfg.output), CACHE))
      for spec in self.extra_methods.values():
        methods.load(spec)
      self.setup = run_setup.setup(self.cfg, lambda *a, **k: None, worker=True)
      self.setup.resume.fence = self.fence
      self.where += f" ({', '.join(sorted({d.platform for d in jax.local_devices()}))} x{len(jax.local_devices())})"
    return self.where

  def run(self, key: str) -> dict:
    """Runs the unit ``key`` from its saved progress; what the driver's progress lines need of it."""
    self.start()
    unit = next(u for u in self.setup.units if u.key == key)
    measured = None  # the method's cost on this actor's devices, if the driver has none yet
    if (unit.method, unit.seed) != self.last:
      self.adapter = self.make_adapter(self.setup, unit, self.setup.groups[0])
      self.last = (unit.method, unit.seed)
      if self.cfg.realtime is None:
        from pcsr_jax import cost

        self.setup.costs.update(cost.load(self.setup.resume.dir))  # what the driver has recorded so far
        measured = self.probe_once(self.setup, unit.method, self.adapter)
    self.stop.requested = False
    lines: list[str] = []  # what the unit says (a resume on other devices): the driver logs it
    try:
      last = self.run_unit(self.setup, unit, self.adapter, self.stop, None, lambda line, **k: lines.append(line))
    except lock.Fenced as e:  # a dead or replaced driver: nothing more is written, the actor goes
      import ray

      print(f"{self.where}: {key}: dropped, not saved: {e}", file=sys.stderr, flush=True)
      ray.actor.exit_actor()
    rec = self.setup.finished.pop(key, None)
    if last is None or rec is None:
      return dict(done=False, lines=lines, cost=measured)
    n = sum(r["num_samples"] for r in rec.records)
    correct = sum(round(r["accuracy"] * r["num_samples"]) for r in rec.records)
    return dict(done=True, seen=n, correct=correct, total_seconds=rec.throughput["seconds"], domain=last[0],
                records=last[1], lines=lines, cost=measured)

  def request_stop(self) -> None:
    self.stop.requested = True


class _ActorStop:
  """A stop flag as `units.Stop` has it, set by the driver (`UnitRunner.request_stop`), not by a signal."""

  requested = False


@dataclasses.dataclass
class _Done:
  """What `runlog.Units.finish` reads of a unit an actor finished."""

  seen: int
  correct: int
  total_seconds: float


def execute(setup: Any, queue: units.Queue, tracker: runlog.Units, stop: Any, log, run_unit: Callable,
            make_adapter: Callable, probe_once: Callable, record_cost: Callable) -> bool:
  """Runs the queue's units on the cluster's actors (each runs a unit with ``run_unit`` on the adapter
  ``make_adapter`` gives, a method's cost measured on its first adapter with ``probe_once``: `harness`'s); the
  driver records the costs the actors measured (``record_cost``). False when stopped (every unit's progress
  saved)."""
  cfg = setup.cfg
  ray = ray_cluster.require_ray(cfg.ray_address, timeout_s=cfg.ray_timeout)
  left = queue.left()
  if not left:
    return True
  gen = lock.generation(cfg.output)
  fence = lock.Fence(cfg.output, gen) if gen is not None else None
  disconnect = ray_cluster.connect(cfg.ray_address, cfg.ray_timeout, log)
  stop.install()  # ray.init's SIGTERM handler out: a signal stops the run, each actor saving its unit's progress
  actors: list = []
  try:
    log(ray_cluster.exposure(cfg.ray_address))
    resources = ray.cluster_resources()
    n, opts = ray_cluster.pool(resources, cfg.devices_per_unit, left)
    log(f"Ray cluster {cfg.ray_address or '(local, 127.0.0.1)'}: {resources.get('CPU', 0):g} CPUs, "
        f"{resources.get('GPU', 0):g} GPUs; {n} actor(s) of {opts} for {left} unit(s) left")
    from pcsr_jax import methods

    extra = {m: methods.origin(m) for m in cfg.methods if not methods.origin(m).startswith("pcsr_jax.")}
    worker_cfg = dataclasses.replace(cfg, progress=False)
    runner = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=2)(UnitRunner)
    actors = [runner.options(**opts).remote(worker_cfg, extra, [os.getcwd()] + sys.path, run_unit, make_adapter,
                                            probe_once, fence) for _ in range(n)]
    return _drive(ray, actors, queue, tracker, stop, log, fence, lambda m, c: record_cost(setup, m, c, log))
  finally:
    for a in actors:
      ray.kill(a, no_restart=True)
    disconnect()


def _drive(ray, actors: list, queue: units.Queue, tracker: runlog.Units, stop: Any, log,
           fence: Optional[lock.Fence] = None, on_cost: Callable = lambda m, c: None) -> bool:
  """The driver's loop: an actor that is up gets the next unit (its last method and seed's first); a finished
  unit is recorded; a lost one goes out again, and its actor is waited for until Ray has restarted it (unless
  the driver's own hold on --output is gone: its lock file removed or replaced, which fences every actor)."""
  lost_errors = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
  inflight: dict = {}  # ObjectRef -> (actor index, its unit, or None for a start)
  where = [""] * len(actors)
  last: list[Optional[tuple]] = [None] * len(actors)
  idle: set[int] = set()  # actors up with nothing to run
  losses: collections.Counter = collections.Counter()
  status = ""
  for i, a in enumerate(actors):
    inflight[a.start.remote()] = (i, None)
  running_since = time.monotonic()
  while queue.left() and not stop.requested:
    for i in sorted(idle):  # units handed back (a lost actor's) go to the actors that are up and idle
      nxt = queue.next(prefer=last[i])
      if nxt is None:
        break
      idle.discard(i)
      last[i] = (nxt.method, nxt.seed)
      tracker.start(nxt, where[i])
      name = f"{nxt.key} [{status or 'no unit done yet'}]"  # the dashboard's task list shows the table's progress
      inflight[actors[i].run.options(name=name).remote(nxt.key)] = (i, nxt)
    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
    if any(u is not None for _, u in inflight.values()):
      running_since = time.monotonic()
    elif time.monotonic() - running_since > NO_ACTOR_S:
      raise UserError(f"--executor ray: no actor could be started or restarted in {NO_ACTOR_S:.0f} s with "
                      f"{queue.left()} unit(s) left; does the cluster have the resources (--devices-per-unit)?")
    if not ready:
      continue
    i, unit = inflight.pop(ready[0])
    try:
      out = ray.get(ready[0])
    except lost_errors as e:
      where[i] = ""
      try:
        if fence is not None:
          fence.check()
      except lock.Fenced:
        raise UserError(f"--output {fence.output}: its lock file {lock.LOCK_FILE} was removed or replaced while "
                        f"this run held it; the actors cannot save progress there; rerun with --resume") from None
      if unit is not None:
        queue.finish(unit, done=False)
        losses[unit.key] += 1
        log(f"{unit.key}: its actor was lost ({type(e).__name__}); handed out again, from its saved progress")
        if losses[unit.key] >= MAX_LOSSES:
          raise UserError(f"{unit.key}: {MAX_LOSSES} actors died running it; see the Ray logs of its nodes "
                          f"(out of memory?)") from None
      inflight[actors[i].start.remote()] = (i, None)  # answered once Ray has restarted the actor
      continue
    except ray.exceptions.RayTaskError as e:
      cause = getattr(e, "cause", None)
      if isinstance(cause, UserError):
        raise UserError(f"{where[i] or 'a Ray actor'}: {cause}") from None
      raise
    for line in (out.get("lines", []) if unit is not None else []):
      log(f"{where[i]}: {line}")
    if unit is not None and out.get("cost"):
      on_cost(unit.method, out["cost"])
    if unit is None:
      if not where[i]:
        log(f"Ray actor {i} up on {out}")
      where[i] = out
    elif out["done"]:
      queue.finish(unit, done=True)
      status = tracker.finish(unit, _Done(out["seen"], out["correct"], out["total_seconds"]), out["domain"],
                              out["records"])
    else:
      queue.finish(unit, done=False)
    idle.add(i)
  if not stop.requested:
    return True
  for a in actors:
    a.request_stop.remote()
  pending = [r for r, (_, u) in inflight.items() if u is not None]
  if pending:
    ray.wait(pending, num_returns=len(pending), timeout=120)
  return False
