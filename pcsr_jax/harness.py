"""The run loop: every (seed, method) unit over the segments of the setting, one compiled step per method, each
batch decoded ahead of the step and its predictions read one step late (the host never waits on the step it
just dispatched). Progress is saved every ``checkpoint_every`` batches and on SIGINT/SIGTERM; ``resume=True``
continues bit-identically on CPU. Under `jax.distributed` every process streams the same global batches
(`distributed.batches`); process 0 alone logs and writes. Around the loop: `config` (the configuration and its
checks), `run_setup` (what the units share), `progress` (the progress on disk, the resume keys), `runlog` (log
and progress lines), `results` (records and outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import time
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pcsr_jax import distributed, engine, results, runlog
from pcsr_jax.config import RunConfig
from pcsr_jax.data import streams
from pcsr_jax.errors import UserError
from pcsr_jax.progress import UnitProgress
from pcsr_jax.run_setup import Setup, setup as _setup


class _Stop:
  """SIGINT/SIGTERM set ``requested``; the loop saves its progress at the next batch and exits."""

  requested = False

  def __enter__(self):
    on = lambda signum, frame: setattr(self, "requested", True)
    self._old = {s: signal.signal(s, on) for s in (signal.SIGINT, signal.SIGTERM)}
    return self

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def run(cfg: RunConfig, log=print) -> dict:
  """Runs the experiment; returns ``{'records', 'curves', 'skipped', ...}`` and writes the outputs, every log
  line also in ``<output>/log.txt`` (`runlog.Log`).

  Under `jax.distributed` every process calls this with the same config; only process 0 logs and writes."""
  log = runlog.for_run(cfg.output, cfg.resume, log if distributed.is_main() else lambda *a, **k: None)
  setup = _setup(cfg, log)
  try:
    with _Stop() as stop:
      for seed in cfg.seeds:
        if not _run_seed(setup, seed, stop, log):
          log(f"interrupted: progress saved to {setup.resume.path}; rerun with --resume to continue")
          raise SystemExit(130)
  finally:
    setup.loader.close()  # the decode processes, if any
  return results.write_outputs(setup, log)


def _run_seed(setup: Setup, seed: int, stop: _Stop, log) -> bool:
  """Every method over the seed's stream; False when interrupted (progress saved)."""
  cfg = setup.cfg
  segments = streams.build(cfg.setting, [len(s) for s in setup.srcs], [s.labels for s in setup.srcs],
                           setup.names, seed, shuffle=cfg.shuffle, imbalance_ratio=cfg.imbalance_ratio,
                           index_file=cfg.label_shift_indices)
  if cfg.limit:
    segments = [dataclasses.replace(s, source_ids=s.source_ids[:cfg.limit], indices=s.indices[:cfg.limit])
                for s in segments]
  for method_name in cfg.methods:
    key = f"{method_name}/seed{seed}"
    if key in setup.progress.done:
      continue
    plan = setup.plans[method_name]
    setup.progress.source_keys[key] = plan.source_key  # saved with the unit's progress
    adapter = engine.Adapter(plan.method, setup.model, setup.params, batch_size=cfg.batch_size,
                             eval_order=cfg.eval_order, seed=seed, source_stats=plan.stats,
                             mean=setup.meta["mean"], std=setup.meta["std"], row_chunk=cfg.row_chunk)
    if not _run_unit(setup, key, method_name, seed, adapter, segments, stop, log, plan.used):
      return False
  return True


@dataclasses.dataclass
class _Unit:
  """A unit as it streams: its progress, the adapter and state, its display and accuracy curve."""

  key: str
  progress: UnitProgress
  adapter: engine.Adapter
  state: Any
  bar: runlog.Progress
  curve: dict
  pending: Any = None  # (predictions, finite, batch, domain, batch index) of the batch read one step late
  since_save: int = 0


def _run_unit(setup: Setup, key: str, method_name: str, seed: int, adapter: engine.Adapter, segments: list,
              stop: _Stop, log, source_used: str = "none") -> bool:
  """One method and seed over all segments. Returns False when interrupted (progress saved)."""
  cfg, progress = setup.cfg, setup.progress
  saved = progress.unit if progress.unit and progress.unit.key == key else None
  state = None
  if saved is not None:
    template = adapter.state_to_host(adapter.init_state())
    state = adapter.state_from_host(setup.resume.restore_state(progress, template))
  up = saved or UnitProgress(key=key)
  n_batches = [-(-len(s.indices) // cfg.batch_size) for s in segments]
  bar = runlog.Progress(cfg.progress, key, sum(n_batches), sum(n_batches[:up.segment]) + up.batch, log)
  u = _Unit(key, up, adapter, state, bar, progress.curves.setdefault(key, {"seen": [], "accuracy": []}))
  for si in range(up.segment, len(segments)):
    seg = segments[si]
    if (seg.reset and up.batch == 0) or u.state is None:
      u.state = adapter.reset(u.state)
    if not _stream_segment(setup, u, seg, stop):
      bar.close()
      return False
    recs = results.record_segment(setup, up, seg, method_name, seed, adapter.eval_order, int(u.state.resets),
                                  source_used)
    up.close_segment()
    bar.segment(seg.name, recs, up.seen, up.correct, up.images_per_s)
  bar.close()
  progress.throughput[key] = dict(images=up.seen, seconds=up.total_seconds, images_per_s=up.images_per_s)
  progress.done.append(key)
  progress.unit = None
  if distributed.is_main():
    setup.resume.save(progress)
  log(f"{key}: accuracy {100 * up.correct / max(up.seen, 1):.2f}% over {up.seen:,} images, "
      f"{up.images_per_s:.1f} img/s end to end")
  return True


def _stream_segment(setup: Setup, u: _Unit, seg, stop: _Stop) -> bool:
  """The segment's batches from where the unit stands, saving progress every ``checkpoint_every`` batches;
  False when stopped (progress saved)."""
  progress, up = setup.progress, u.progress
  predict = _predictor(u.adapter.mesh)
  t_seg = time.perf_counter()
  for batch, placed, stop_now in _batches(setup, u.adapter, seg, up.batch, stop):
    progress.skipped += [n for n in (f"{seg.name}/{n}" for n in batch.skipped) if n not in progress.skipped]
    up.skipped += len(batch.skipped)
    if placed is not None:
      u.state, logits, metrics = u.adapter.step_placed(u.state, placed)
      preds = predict(logits)  # stays on device; read one step later
      _score(setup, u)
      u.pending = (preds, metrics["finite"], batch, seg.name, up.batch)
    up.batch += 1
    u.since_save += 1
    u.bar.update(up.seen, up.correct, up.total_seconds + up.seconds + time.perf_counter() - t_seg, seg.name)
    if stop_now or u.since_save >= setup.cfg.checkpoint_every:
      _score(setup, u)
      up.add_time(time.perf_counter() - t_seg)
      t_seg = time.perf_counter()
      progress.unit = up
      if distributed.is_main():
        setup.resume.save(progress, u.adapter.state_to_host(u.state))
      u.since_save = 0
      if stop_now:
        return False
  _score(setup, u)
  up.add_time(time.perf_counter() - t_seg)
  return True


def _score(setup: Setup, u: _Unit) -> None:
  """Scores the batch read one step late, if any; a diverged step stops the run."""
  if u.pending is None:
    return
  preds, finite, batch, domain, at_batch = u.pending
  u.pending = None
  if not bool(finite):
    raise UserError(f"{u.key} diverged on {domain} at batch {at_batch}: non-finite logits or adapted parameters "
                    f"(lower its learning rate in --method-args)")
  u.progress.account(preds, batch, setup.names, setup.relabel, setup.num_classes, u.curve)


@functools.lru_cache(maxsize=None)
def _predictor(mesh) -> Any:
  """logits -> the predicted classes of the whole batch on every device, so that every process can read them
  (under `jax.distributed` the logits' rows are spread over the processes); dispatched without waiting."""
  return jax.jit(lambda logits: logits.argmax(-1), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _batches(setup: Setup, adapter: engine.Adapter, seg, start_batch: int, stop: _Stop):
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
