"""The run loop: the run's units (a method and seed on a domain, or on the whole stream: `units`), one per device
group at once, each taken from the run's queue, streamed with one compiled step per method and seed, each batch
decoded ahead of the step and its predictions read one step late (the host never waits on the step it just
dispatched). Each method's cost is measured on its first adapter, before its first unit (`probe_once`,
`pcsr_jax.cost`); under ``--realtime`` every method's before any unit (`measure_costs`), and a method of relative
cost C adapts on a domain's batches 0, C, 2C, ... and predicts the others with a forward of its latest params
(`pcsr_jax.realtime`). A unit's progress is saved every ``checkpoint_every``
batches and on SIGINT/SIGTERM; ``resume=True`` continues bit-identically on CPU; ``executor='ray'`` runs the units
on a Ray cluster's actors (`ray_units`). Under `jax.distributed` every process streams the same global batches
(`distributed.batches`); process 0 alone logs and writes. Around the loop: `config` (the configuration and its
checks), `run_setup` (what the units share), `progress` (the progress on disk, the resume keys), `runlog` (log and
progress lines), `results` (records and outputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pcsr_jax import cost, distributed, engine, events, files, lock, plots, progress, realtime, results, runlog, units
from pcsr_jax.config import RunConfig
from pcsr_jax.errors import UserError
from pcsr_jax.progress import UnitProgress, UnitRecord
from pcsr_jax.run_setup import Setup, setup as _setup

# A step longer than this (MEMO's 64 augmented passes per image, DDA's diffusion) is not queued behind the one
# before it: a stop then waits for the step in flight only.
SLOW_STEP_S = 1.0
# What a run writes in its output folder, checked for links before it writes (`files.refuse_links`); the folders
# among them are walked.
OUTPUT_NAMES = (runlog.LOG_FILE, "results.json", "results.csv", "table.md", *plots.PLOTS, events.DIR,
                progress.RESUME_DIR, "predictions")
OUTPUT_FOLDERS = (events.DIR, progress.RESUME_DIR, "predictions")


def run(cfg: RunConfig, log=print) -> dict:
  """Runs the experiment; returns ``{'records', 'curves', 'skipped', ...}`` and writes the outputs, every log
  line also in ``<output>/log.txt`` (`runlog.Log`). The run holds ``cfg.output`` (`lock.hold`) from before it
  reads or discards any progress there: a second run on the same folder is refused. With ``cfg.executor ==
  'ray'`` the units run on the actors of a Ray cluster (`pcsr_jax.ray_units`) and this process, the driver,
  writes the outputs.

  Under `jax.distributed` every process calls this with the same config; only process 0 logs and writes."""
  main = distributed.is_main()
  with lock.hold(cfg.output, " ".join(sys.argv)) if main else contextlib.nullcontext():
    if main:  # nothing is written through a link out of the folder (the held lock file is never one: `lock`)
      files.refuse_links(cfg.output, OUTPUT_NAMES, OUTPUT_FOLDERS)
    headed = isinstance(log, runlog.Log)  # the built-in benchmark's command logged its own header
    log = runlog.for_run(cfg.output, cfg.resume, log if main else lambda *a, **k: None)
    if not headed:  # the log file starts with what it runs
      log(runlog.header(cfg, sys.argv))
    setup = _setup(cfg, log)
    queue = units.Queue(setup.units, setup.done)
    passes = {m: units.declared_passes(p.method) for m, p in setup.plans.items()}
    tracker = runlog.Units(setup.units, setup.done, log, say_starts=cfg.executor == "ray" or len(setup.groups) > 1,
                           passes=passes)
    try:
      with units.Stop(log) as stop:
        if cfg.realtime is not None:  # each method's C before any unit: the schedule depends on it
          measure_costs(setup, log)
        else:  # measured on each method's first adapter, which its units then use (`probe_once`)
          setup.costs = cost.load(setup.resume.dir) if cfg.resume else {}
        if cfg.executor == "ray":
          from pcsr_jax import ray_units

          finished = ray_units.execute(setup, queue, tracker, stop, log, run_unit, make_adapter, probe_once,
                                       record_cost)
        else:
          executors = [functools.partial(_executor, setup, queue, mesh, stop, tracker, log) for mesh in setup.groups]
          finished = units.execute(executors, stop)
        if not finished:
          log(f"interrupted: progress saved to {setup.resume.dir}; rerun with --resume to continue")
          raise SystemExit(130)
    finally:
      setup.loader.close()  # the decode processes, if any
    return results.finish(setup, log)


def _executor(setup: Setup, queue: units.Queue, mesh, stop: units.Stop, tracker: runlog.Units, log) -> bool:
  """One device group's loop: takes a unit, runs it, until none is left; False when stopped (progress saved).
  An adapter (its compiled step) serves the units of one method and seed one after another."""
  adapter, last = None, None
  while not stop.requested and (unit := queue.next(prefer=last)) is not None:
    if (unit.method, unit.seed) != last:
      adapter = make_adapter(setup, unit, mesh)
      last = (unit.method, unit.seed)
      c = probe_once(setup, unit.method, adapter)
      if c is not None:
        record_cost(setup, unit.method, c, log)
    tracker.start(unit)
    done = run_unit(setup, unit, adapter, stop, tracker, log) is not None
    queue.finish(unit, done)
    if not done:
      return False
  return not stop.requested


def make_adapter(setup: Setup, unit: units.Unit, mesh) -> engine.Adapter:
  """The adapter (one compiled step) of the unit's method and seed on ``mesh``."""
  return _adapter(setup, unit.method, unit.seed, mesh)


def _adapter(setup: Setup, method: str, seed: int, mesh) -> engine.Adapter:
  """The adapter of a method of the run, or of Source where it is only ``--realtime source``'s clock."""
  from pcsr_jax import methods
  from pcsr_jax.run_setup import MethodPlan

  cfg = setup.cfg
  plan = setup.plans[method] if method in setup.plans else MethodPlan(methods.get(method))
  return engine.Adapter(plan.method, setup.model, setup.params, batch_size=cfg.batch_size,
                        eval_order=cfg.eval_order if method in setup.plans else None, seed=seed,
                        source_stats=plan.stats, mesh=mesh,
                        mean=setup.meta["mean"], std=setup.meta["std"], row_chunk=cfg.row_chunk)


class _NoStop:
  requested = False


_PROBING = threading.Lock()  # device groups in threads take a method's probe once between them


def probe_once(setup: Setup, method: str, adapter: engine.Adapter) -> Optional[dict]:
  """Without ``--realtime``: the method's cost (`cost.probe`) on its first adapter, whose compile it times and
  which its units then use (no second compile), unless measured already (by another device group, an actor, or
  before a ``--resume``); None then. Its steps run on the stream's first batch from the source state, which the
  units' own states never see."""
  with _PROBING:
    if method in setup.costs or method in setup.probing:
      return None
    setup.probing.add(method)
  return cost.probe(adapter, _first_batch(setup, adapter), setup.cfg.cost_batches)


def record_cost(setup: Setup, method: str, c: dict, log) -> None:
  """A method's measured cost into the run's costs (saved with the progress) and the log."""
  with _PROBING:
    if method in setup.costs:
      return
    setup.costs[method] = c
    if distributed.is_main():
      cost.save(setup.resume.dir, setup.costs)
  log(cost.log_lines(method, c))


def measure_costs(setup: Setup, log) -> None:
  """Each method's cost (`cost.probe`), one method after another before any unit runs, on the first device
  group (a Ray driver: its own devices), on the stream's first batch with a readable image; and under
  ``--realtime`` its relative cost C (`realtime.relative_cost`, or ``--realtime-cost``'s). Costs saved with the
  progress are kept (``--resume``: the same C's, so the same schedule). Sets ``setup.costs``."""
  cfg = setup.cfg
  saved = cost.load(setup.resume.dir) if cfg.resume else {}
  costs = {m: saved[m] for m in cfg.methods if m in saved}
  rate = cfg.realtime
  need_source = rate == realtime.SOURCE and "_reveal" not in saved
  todo = [m for m in cfg.methods if m not in costs]
  if need_source and "source" not in cfg.methods:
    todo = ["source"] + todo  # the stream's clock: Source's forward, timed though Source is not a row
  elif need_source:
    todo = ["source"] + [m for m in todo if m != "source"]
  mesh = setup.groups[0] if setup.groups else engine.data_mesh(jax.local_devices())
  reveal = saved.get("_reveal")
  if rate is not None and rate != realtime.SOURCE and reveal is None:
    reveal = dict(rate=rate, seconds=realtime.reveal_seconds(rate, cfg.batch_size, None))
  if todo:
    log(f"timing {len(todo)} method{'s' if len(todo) > 1 else ''}' steps: compiled, then {cfg.cost_batches} steps "
        f"each on the stream's first batch")
  placed = None
  for m in todo:  # Source first under --realtime source: its forward is the stream's clock
    adapter = _adapter(setup, m, cfg.seeds[0], mesh)
    if placed is None:
      placed = _first_batch(setup, adapter)
    c = cost.probe(adapter, placed, cfg.cost_batches, predict=rate is not None)
    del adapter
    if distributed.is_multiprocess():  # every process must follow process 0's schedule
      from jax.experimental import multihost_utils

      keys = ("step_s_median", "step_s_p90", "images_per_s", "compile_s")
      agreed = multihost_utils.broadcast_one_to_all(np.asarray([c[k] for k in keys], np.float64))
      c.update({k: float(v) for k, v in zip(keys, agreed)})
    if m == "source" and need_source:
      reveal = dict(rate=rate, seconds=c["step_s_median"])
      log(f"--realtime {rate}: the stream reveals a batch every {1e3 * reveal['seconds']:.1f} ms "
          f"({realtime.describe(rate)})")
    if m not in cfg.methods:
      continue
    if rate is not None:
      if m in cfg.realtime_cost:
        c.update(realtime_c=cfg.realtime_cost[m], realtime_c_from="--realtime-cost")
      else:
        c.update(realtime_c=realtime.relative_cost(c["step_s_median"], reveal["seconds"]), realtime_c_from="measured")
    costs[m] = c
    log(cost.log_lines(m, c))
  setup.costs = dict(costs, **({"_reveal": reveal} if reveal is not None else {}))
  if distributed.is_main():
    cost.save(setup.resume.dir, setup.costs)


def _first_batch(setup: Setup, adapter: engine.Adapter) -> tuple:
  """The stream's first batch with a readable image, placed for ``adapter``'s mesh."""
  for seg in setup.segments[setup.cfg.seeds[0]]:
    for _, placed, _ in _batches(setup, adapter, seg, 0, _NoStop()):
      if placed is not None:
        return placed
  raise UserError("no readable image in the stream to time the methods' steps on")


def realtime_c(setup: Setup, method: str) -> int:
  """The method's relative cost C under ``--realtime`` (1 without it): adapts on one batch in C."""
  if setup.cfg.realtime is None:
    return 1
  if method not in setup.costs:  # a Ray actor: the driver measured and saved them before handing out units
    setup.costs = cost.load(setup.resume.dir)
  return int(setup.costs[method]["realtime_c"])


@dataclasses.dataclass
class _Unit:
  """A unit as it streams: its record, progress, adapter and state, and its display."""

  unit: units.Unit
  rec: UnitRecord
  progress: UnitProgress
  adapter: engine.Adapter
  state: Any
  bar: runlog.Progress
  events: events.UnitEvents
  pending: Any = None  # (predictions, metrics, batch, domain, batch index) of the batch read one step late
  since_save: int = 0
  ready_at: float = dataclasses.field(default_factory=time.perf_counter)  # when the last step's result was read
  c: int = 1  # --realtime: the method's relative cost (adapts on one batch in c)
  step_s: float = 0.0  # the time between the last two results: a step's, once compiled
  t_seg: float = 0.0  # when the open segment's stepping time since its last save began


def run_unit(setup: Setup, unit: units.Unit, adapter: engine.Adapter, stop: units.Stop,
             tracker: Optional[runlog.Units], log) -> Optional[tuple[str, list]]:
  """One unit over its segments, from its saved progress if any. Returns its last domain's name and records,
  None when interrupted (saved). ``tracker`` None (a Ray actor): no progress lines, the driver logs them."""
  cfg, plan = setup.cfg, setup.plans[unit.method]
  rec = setup.resume.load_unit(unit.key) or UnitRecord(unit.key, source_key=plan.source_key)
  state = None
  if rec.progress is not None:
    template = adapter.state_to_host(adapter.init_state())
    state = adapter.state_from_host(setup.resume.restore_state(rec, template))
    devices = int(adapter.mesh.devices.size)
    if rec.devices is not None and rec.devices != devices:  # the executor or its groups changed (`HOW_IT_RUNS`)
      log(f"{unit.key}: saved on {rec.devices} device(s), continuing on {devices}: the rest of it splits each "
          f"batch over another number of devices, which rounds sums differently (float32); finished units are "
          f"unaffected")
  up = rec.progress or UnitProgress(key=unit.key)
  segments = [setup.segments[unit.seed][i] for i in unit.segments]
  n_batches = [-(-len(s.indices) // cfg.batch_size) for s in segments]
  bar = runlog.Progress(cfg.progress, unit.key, sum(n_batches), sum(n_batches[:up.segment]) + up.batch, log)
  u = _Unit(unit, rec, up, adapter, state, bar, events.UnitEvents(cfg.output, unit.key, distributed.is_main()),
            c=realtime_c(setup, unit.method))
  last: tuple[str, list] = ("", [])  # the last domain's name and records: its line says the unit is done
  for si in range(up.segment, len(segments)):
    seg = segments[si]
    if (seg.reset and up.batch == 0) or u.state is None:
      u.state = adapter.reset(u.state)
    if not _stream_segment(setup, u, seg, stop):
      bar.close()
      u.events.close()
      return None
    recs = results.record_segment(setup, rec.records, up, seg, unit.method, unit.seed, adapter.eval_order,
                                  int(u.state.resets), plan.used)
    up.close_segment()
    u.events.domain(up.seen, recs)
    if si < len(segments) - 1 and tracker is not None:
      tracker.domain(unit, seg.name, recs, up)
    last = (seg.name, recs)
  bar.close()
  rec.done, rec.progress = True, None
  rec.throughput = dict(images=up.seen, seconds=up.total_seconds, images_per_s=up.images_per_s)
  if distributed.is_main():
    setup.resume.save_unit(rec)
  u.events.flush()
  u.events.close()
  setup.finished[unit.key] = rec
  if tracker is not None:
    tracker.finish(unit, up, *last)
  return last


def _stream_segment(setup: Setup, u: _Unit, seg, stop: units.Stop) -> bool:
  """The segment's batches from where the unit stands, saving progress every ``checkpoint_every`` batches;
  False when stopped (progress saved)."""
  rec, up = u.rec, u.progress
  predict = _predictor(u.adapter.mesh)
  u.t_seg = time.perf_counter()
  for batch, placed, stop_now in _batches(setup, u.adapter, seg, up.batch, stop):
    if u.pending is not None and u.step_s > SLOW_STEP_S:
      _wait(u.pending[0])  # a long step: the next one waits for it, so that a stop waits for one step, not two
    if stop_now or (stop.requested and not distributed.is_multiprocess()):  # (processes agree through stop_now)
      _save(setup, u)  # this batch is not run: the progress is the last finished batch's
      return False
    rec.skipped += [n for n in (f"{seg.name}/{n}" for n in batch.skipped) if n not in rec.skipped]
    up.skipped += len(batch.skipped)
    if placed is not None and u.c > 1 and not realtime.adapts(up.batch, u.c):
      # --realtime: the stream revealed this batch while the method adapted on an earlier one; a forward of the
      # latest adapted params predicts it, and it is not adapted on (`realtime`'s protocol points).
      logits, metrics = u.adapter.predict_placed(u.state, placed)
      metrics = dict(metrics, adapted=False)
    elif placed is not None:
      u.state, logits, metrics = u.adapter.step_placed(u.state, placed)
      if u.c > 1:
        metrics = dict(metrics, adapted=True)
    if placed is not None:
      preds = predict(logits)  # stays on device; read one step later
      _score(setup, u)
      u.pending = (preds, metrics, batch, seg.name, up.batch)
    up.batch += 1
    u.since_save += 1
    u.bar.update(up.seen, up.correct, _seconds(u), seg.name)
    if u.since_save >= setup.cfg.checkpoint_every:
      _save(setup, u)
  _score(setup, u)
  up.add_time(time.perf_counter() - u.t_seg)
  return True


def _seconds(u: _Unit) -> float:
  """The unit's stepping time so far: its closed segments', and the open one's."""
  return u.progress.total_seconds + u.progress.seconds + time.perf_counter() - u.t_seg


def _save(setup: Setup, u: _Unit) -> None:
  """Saves the unit's progress after its last dispatched step (scored first), then its events up to it."""
  _score(setup, u)
  u.progress.add_time(time.perf_counter() - u.t_seg)
  u.t_seg = time.perf_counter()
  u.rec.progress = u.progress
  u.rec.devices = int(u.adapter.mesh.devices.size)
  if distributed.is_main():
    setup.resume.save_unit(u.rec, u.adapter.state_to_host(u.state))
  u.events.flush()
  u.since_save = 0


def _wait(x: Any) -> None:
  """Waits for ``x`` in short sleeps, not one blocking read: a SIGINT/SIGTERM's handler (`units.Stop`) runs in
  the main thread within 20 ms and says at once that the run is stopping."""
  while not x.is_ready():
    time.sleep(0.02)


def _score(setup: Setup, u: _Unit) -> None:
  """Scores the batch read one step late, if any; a diverged step stops the run."""
  if u.pending is None:
    return
  preds, metrics, batch, domain, at_batch = u.pending
  u.pending = None
  finite = bool(metrics["finite"])
  now = time.perf_counter()
  u.step_s, u.ready_at = now - u.ready_at, now  # steady state: the time of a step
  if not finite:
    raise UserError(f"{progress.stem(u.unit.key)} diverged on {domain} at batch {at_batch}: non-finite logits or "
                    f"adapted parameters (lower its learning rate in --method-args)")
  u.progress.account(preds, batch, setup.names, setup.relabel, setup.num_classes, u.rec.curve)
  u.events.batch(u.progress.seen, u.progress.correct, _seconds(u), metrics)


@functools.lru_cache(maxsize=None)
def _predictor(mesh) -> Any:
  """logits -> the predicted classes of the whole batch on every device, so that every process can read them
  (under `jax.distributed` the logits' rows are spread over the processes); dispatched without waiting."""
  return jax.jit(lambda logits: logits.argmax(-1), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _batches(setup: Setup, adapter: engine.Adapter, seg, start_batch: int, stop: units.Stop):
  """``(batch, placed, stop_now)`` per global batch of a segment from ``start_batch`` on.

  ``batch`` has the labels, names and tags of the batch's readable images (the same on every process),
  ``placed`` its images on the mesh (None when none was readable), ``stop_now`` whether to save and stop after
  it. One process decodes the whole batch; under `jax.distributed` see `distributed.batches`."""
  if distributed.is_multiprocess():
    yield from distributed.batches(setup, adapter, seg, start_batch, stop)
    return
  for b in setup.loader.batches(seg.source_ids, seg.indices, start_batch=start_batch):
    placed = adapter.place(b.images) if len(b.labels) else None
    if placed is not None and setup.corrupters is not None:  # one source per batch (`_no_device_path`)
      sid = int(b.tags[0])
      placed = (setup.corrupters[sid](placed[0], setup.srcs[sid].keys(b.names)), placed[1])
    yield b, placed, stop.requested
