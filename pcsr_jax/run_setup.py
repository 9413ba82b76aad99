"""What every unit of a run shares, settled before any work (`setup`): the checkpoint, each method as it will
run with its inputs checked, the stream's sources and their loader, and the progress on disk (fresh, or
resumed after its keys were checked: `pcsr_jax.progress`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import numpy as np

from pcsr_jax import (ccc_stream, checkpoint, distributed, events, methods, platforms, progress, results, source_stats,
                      units)
from pcsr_jax.config import RunConfig
from pcsr_jax.data import datasets, sources, streams
from pcsr_jax.data.loader import Loader
from pcsr_jax.errors import UserError
from pcsr_jax.models import vit
from pcsr_jax.models.vit import compute_dtype
from pcsr_jax.progress import Resume


@dataclasses.dataclass
class MethodPlan:
  """A method of the run as settled before any work: what runs (EATA's source-free form without
  ``--source-data``), its source statistics and what its records say about them, and ``source_key``, what its
  units' statistics depend on (`source_stats.key`; "none..." without statistics), which ``--resume`` must
  find unchanged for a unit it continues or keeps."""

  method: methods.Method
  used: str = "none"
  source_key: str = "none"
  described: Optional[tuple] = None  # `source_stats.describe`'s (indices, description)
  stats: Optional[dict] = None


@dataclasses.dataclass
class Setup:
  """What every unit of a run shares: the model, the data, the loader, the progress on disk."""

  cfg: RunConfig
  spec: datasets.DatasetSpec
  model: Any
  params: Any
  num_classes: int
  names: list[str]
  srcs: list
  relabel: Optional[np.ndarray]
  loader: Any
  resume: Resume
  config_json: dict
  decode_ips: float
  exchange: distributed.Exchange  # the processes' per-batch agreement (`pcsr_jax.distributed`)
  meta: dict = dataclasses.field(default_factory=dict)
  plans: dict = dataclasses.field(default_factory=dict)  # method name -> MethodPlan
  source: Optional[source_stats.SourceData] = None  # --source-data, opened before any work if a method uses it
  ckpt_digest: str = ""  # `checkpoint.params_digest` of the checkpoint: in the resume key and the stats' key
  ccc: Optional[dict] = None  # --setting ccc: its calibration and walk, for results.json
  corrupters: Optional[list] = None  # --corrupt-on device: one `corrupt_device.BatchCorrupter` per source
  segments: dict = dataclasses.field(default_factory=dict)  # seed -> its stream's segments (`streams.build`)
  units: list = dataclasses.field(default_factory=list)  # the run's `units.Unit`s in plan order
  done: set = dataclasses.field(default_factory=set)  # units finished already
  finished: dict = dataclasses.field(default_factory=dict)  # key -> `progress.UnitRecord` of the units run here
  groups: list = dataclasses.field(default_factory=list)  # one device mesh per group that runs a unit at once
  platform: str = "cpu"  # the run's devices' (`platforms.of_devices`): what --attention auto chose for
  costs: dict = dataclasses.field(default_factory=dict)  # method -> its cost fields (`cost`), and --realtime's C
  probing: set = dataclasses.field(default_factory=set)  # methods whose cost a device group is measuring

  def columns(self) -> list[str]:
    """The table's and plots' columns: the domains, or for the gradual setting the corruptions (each the mean
    of its 9 passes)."""
    return list(self.cfg.corruptions) if self.cfg.setting == "gradual" else self.names


@dataclasses.dataclass
class _Stream:
  """The stream's sources as `_open_stream` opens them."""

  names: list[str]
  srcs: list
  num_classes: int
  relabel: Optional[np.ndarray]
  model: Any
  ccc: Optional[dict]


def setup(cfg: RunConfig, log, worker: bool = False) -> Setup:
  """Validates the config, loads the checkpoint, checks every method's inputs, opens the data and its loader,
  and loads or starts the progress: everything before the first unit. A ``worker`` (a Ray actor running units
  for the driver, `pcsr_jax.ray_units`) reads the driver's progress and writes none of its own."""
  cfg.validate()
  spec = datasets.get(cfg.dataset)
  model, params, meta = checkpoint.load(cfg.checkpoint, kind="vit")
  # The model as the run's devices run it (`vit.for_platform`: the attention kernel, the CPU-only backward
  # passes); every unit's step, the source statistics and CCC's calibration use it.
  platform = platforms.of_devices(jax.local_devices())
  model = vit.for_platform(model.clone(dtype=compute_dtype(cfg.dtype), attention=cfg.attention), platform)
  ckpt_digest = checkpoint.params_digest(params)  # once: the resume key and every statistics' key use it
  exchange = distributed.Exchange()
  # Every method's inputs (DePT-G's prompts, DDA's UNet) and --source-data, checked before any work.
  plans, source = plan_methods(cfg, model, params, meta, ckpt_digest, log)
  stream = _open_stream(cfg, spec, model, params, meta, ckpt_digest, exchange, log)
  loader, decode_ips, corrupters = _make_loader(cfg, spec.preprocess(meta), stream.srcs, log)
  resume = Resume(cfg.output)
  segments = {seed: stream_segments(cfg, stream.srcs, stream.names, seed) for seed in cfg.seeds}
  plan = units.plan(cfg.setting, cfg.seeds, {m: p.method for m, p in plans.items()}, segments)
  if worker:
    groups = [_worker_mesh()]
  else:  # a Ray driver runs no unit itself: its actors have the devices
    groups = [] if cfg.executor == "ray" else _device_groups(cfg, len(plan))
  config_json = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
  manifest = dict(config_key=progress.config_key(config_json, ckpt_digest), data_key=progress.data_key(stream.srcs),
                  units=[u.key for u in plan], source_keys={m: p.source_key for m, p in plans.items()})
  done, commit = (_worker_progress if worker else _start_progress)(cfg, resume, exchange, manifest, plan, log)
  s = Setup(cfg, spec, stream.model, params, stream.num_classes, stream.names, stream.srcs, stream.relabel, loader,
            resume, config_json, decode_ips, exchange, meta, plans, source, ckpt_digest, stream.ccc, corrupters,
            segments, plan, done, groups=groups, platform=platform)
  load_source_stats(s, log)  # an unreadable --source-data stops the run before it writes anything
  commit()
  return s


def _worker_mesh():
  """A Ray actor's mesh: every device it was given (Ray sets the GPUs it sees), one unit at a time."""
  from pcsr_jax import engine

  return engine.data_mesh(jax.local_devices())


def _device_groups(cfg: RunConfig, n_units: int) -> list:
  """One mesh per device group that runs a unit at once (`units.device_groups`; ``cfg.devices_per_unit`` set to
  the size chosen, so that results.json says what ran); under `jax.distributed` one unit at a time on every
  process's devices."""
  if distributed.is_multiprocess():
    if cfg.devices_per_unit is not None:
      raise UserError("--devices-per-unit: one process per host runs one unit at a time over every device under "
                      "--coordinator/--distributed; run a table over a cluster with --executor ray instead")
    cfg.devices_per_unit = len(jax.devices())
    return [None]
  from pcsr_jax import engine

  groups = units.device_groups(jax.local_devices(), cfg.devices_per_unit, n_units)
  cfg.devices_per_unit = len(groups[0])
  return [engine.data_mesh(g) for g in groups]


def _open_stream(cfg: RunConfig, spec: datasets.DatasetSpec, model, params, meta: dict, ckpt_digest: str,
                 exchange: distributed.Exchange, log) -> _Stream:
  """The run's domains (CCC's walk, calibrated first), their labels checked against the head, and the model
  restricted to a dataset's class subset (ImageNet-R/-A: labels become positions in its 200 logits)."""
  ccc_record = None
  with exchange.main_first():  # the built-in benchmark's cache (and CCC's calibration) is filled by one process
    if cfg.setting == "ccc":
      src, ccc_record = ccc_stream.build(cfg, model, params, meta, spec.preprocess(meta), ckpt_digest, log)
      domains = [("ccc", src)]
    else:
      domains = open_domains(spec, cfg, log)
  subset = spec.class_subset()
  for name, src in domains:
    sources.check_classes(src, meta["num_classes"], subset, spec.where(cfg, streams.split_domain(name, 0)[0]))
  relabel, num_classes = None, meta["num_classes"]
  if subset is not None:
    model = model.clone(class_subset=tuple(int(c) for c in subset))
    relabel = np.full(meta["num_classes"], -1, np.int64)
    relabel[subset] = np.arange(len(subset))
    num_classes = len(subset)
  return _Stream([n for n, _ in domains], [s for _, s in domains], num_classes, relabel, model, ccc_record)


def _make_loader(cfg: RunConfig, preprocess, srcs: list, log) -> tuple[Loader, float, Optional[list]]:
  """``(loader, decode img/s, corrupters)``: uint8 images for the device to normalize; with ``--corrupt-on
  device`` the clean crops, which the accelerator corrupts (one `corrupt_device.BatchCorrupter` per source)."""
  corrupters = None
  if cfg.corrupt_on == "device":
    from pcsr_jax.data.generators import corrupt_device

    corrupters = [corrupt_device.BatchCorrupter(s.corruption, s.severity, s.seed, preprocess.img_size) for s in srcs]
    loader = Loader(srcs, _crop_as_is, cfg.batch_size, workers=cfg.workers)
  else:
    loader = Loader(srcs, preprocess.to_uint8, cfg.batch_size, workers=cfg.workers)
  kind = loader_kind(cfg.loader, loader)
  loader.processes = kind == "processes"
  decode_ips = loader.throughput(min(256, len(srcs[0])))
  origin = f"generated from the clean images {cfg.clean_data}" if cfg.clean_data else f"from {cfg.data}"
  if cfg.clean_data:
    origin += f", corrupted on the {cfg.corrupt_on}"
  log(f"data: {cfg.dataset} {origin}: {len(srcs)} domain(s), {sum(len(s) for s in srcs):,} images; "
      f"decode + preprocess {decode_ips:.0f} img/s ({loader.workers} {kind})")
  return loader, decode_ips, corrupters


def stream_segments(cfg: RunConfig, srcs: list, names: list[str], seed: int) -> list:
  """The seed's stream (`streams.build`), each segment cut to ``--limit`` images."""
  segs = streams.build(cfg.setting, [len(s) for s in srcs], [s.labels for s in srcs], names, seed,
                       shuffle=cfg.shuffle, imbalance_ratio=cfg.imbalance_ratio, index_file=cfg.label_shift_indices)
  if cfg.limit:
    segs = [dataclasses.replace(s, source_ids=s.source_ids[:cfg.limit], indices=s.indices[:cfg.limit]) for s in segs]
  return segs


def _start_progress(cfg: RunConfig, resume: Resume, exchange: distributed.Exchange, manifest: dict, plan: list,
                    log) -> tuple[set, Any]:
  """The saved progress to continue (``--resume``: its keys checked, `progress.check_resumable`; each unit's
  source statistics, `progress.keeps_statistics`), or a fresh one. Returns the keys of the units finished already
  and what writes the progress (a fresh manifest, the outputs of an earlier run removed; a resumed one's units
  that start over), called once the source statistics are in hand."""
  os.makedirs(cfg.output, exist_ok=True)
  saved = resume.load() if cfg.resume else None
  if cfg.resume:  # a fresh run ignores what the folder holds, so hosts may see different leftovers there
    progress.check_same_progress(exchange, resume)
  main = distributed.is_main()  # the only process that writes in the output folder
  if saved is None:
    if cfg.resume:
      log(f"--resume: no saved progress in {resume.dir}; starting from the beginning")

    def start() -> None:
      if main:
        if os.path.isfile(resume.path):
          log(f"discarding the saved progress in {resume.dir} (pass --resume to continue it)")
        resume.start(manifest)
        results.remove_outputs(cfg.output, log)
    return set(), start
  progress.check_resumable(saved, manifest["config_key"], manifest["data_key"], resume.path, cfg.checkpoint)
  done, started, again = set(), 0, []
  for u in plan:
    rec = resume.load_unit(u.key)
    if rec is None:
      continue
    if not progress.keeps_statistics(rec, manifest["source_keys"][u.method], log):
      again.append(u.key)
      continue
    done.update([u.key] if rec.done else [])
    started += not rec.done
  if done or started:
    log(f"resuming from {resume.path}: {len(done)} of {len(plan)} units done, {started} under way")

  def resume_run() -> None:
    if main:
      for key in again:
        resume.forget_unit(key)
        events.remove_unit(cfg.output, key)  # it runs again from its start: its events too
      resume.rewrite(manifest)
  return done, resume_run


def _worker_progress(cfg: RunConfig, resume: Resume, exchange: distributed.Exchange, manifest: dict, plan: list,
                     log) -> tuple[set, Any]:
  """A Ray actor's view of the driver's progress: the manifest the driver wrote, which this node's checkpoint,
  data and source statistics must match (`progress.check_resumable`); the units finished so far."""
  saved = resume.load()
  if saved is None:
    raise UserError(f"{resume.path}: no progress of the driver in --output {cfg.output} as this node sees it; "
                    f"put --output on a filesystem every node of the cluster shares")
  progress.check_resumable(saved, manifest["config_key"], manifest["data_key"], resume.path, cfg.checkpoint,
                           worker=True)
  if saved.get("source_keys") != manifest["source_keys"]:
    raise UserError(f"{resume.path}: the worker sees other source statistics than the driver (--source-data, "
                    f"--source-images or its images differ); give every node the same data")
  return {u.key for u in plan if (r := resume.load_unit(u.key)) is not None and r.done}, lambda: None


def check_data(cfg: RunConfig) -> None:
  """``cfg`` validated and its data opened and checked against the checkpoint's classes, without loading params
  or running anything: what a table of several runs (`experiments.common.run_many`) checks of every run before
  its first run starts, so that a bad folder of its last run stops it before the others' work."""
  cfg.validate()
  spec = datasets.get(cfg.dataset)
  meta = checkpoint.load_meta(cfg.checkpoint, kind="vit")
  if cfg.setting == "ccc" or spec.generated:  # generated when the run starts (calibrated, cached)
    return
  for name, src in open_domains(spec, cfg, lambda *a, **k: None):
    sources.check_classes(src, meta["num_classes"], spec.class_subset(),
                          spec.where(cfg, streams.split_domain(name, 0)[0]))


def _crop_as_is(img) -> np.ndarray:
  """The device path's loader preprocessing: `generated.CleanCrops` already gives the release's 224 px crop."""
  return np.asarray(img, np.uint8)


def open_domains(spec: datasets.DatasetSpec, cfg: RunConfig, log) -> list:
  """The run's ``[(domain name, source)]``: one per corruption, or for the gradual setting one per corruption
  and severity 1..5 (`streams.gradual_domain`), corruption after corruption."""
  if cfg.setting != "gradual":
    return spec.open(cfg, log)
  by_severity = {s: spec.open(dataclasses.replace(cfg, severity=s), log) for s in streams.SEVERITIES}
  return [(streams.gradual_domain(c, s), by_severity[s][k][1]) for k, c in enumerate(cfg.corruptions)
          for s in streams.SEVERITIES]


def plan_methods(cfg: RunConfig, model, params, meta: dict, ckpt_digest: str, log
                 ) -> tuple[dict[str, MethodPlan], Optional[source_stats.SourceData]]:
  """Each method as it will run, its inputs checked (`Method.check_inputs`), and ``--source-data`` opened and
  checked (classes against the head for a method that reads labels) if a method uses it: before any work, so
  that a bad input stops the run before its first method, not when the method that needs it comes up."""
  plans, data = {}, None
  for name in cfg.methods:
    args = cfg.method_args.get(name, {})
    method = with_preprocessing(methods.get(name, **args), args, meta)
    method.check_inputs(model, params, cfg.batch_size)
    if not method.uses_source_data():
      plans[name] = MethodPlan(method)
    elif cfg.source_data is None:  # `RunConfig.validate` refused the methods without a source-free form
      used = f"none: source-free form ({method.source_free_note()})"
      log(f"{name}: no --source-data; running its source-free form ({method.source_free_note()})")
      plans[name] = MethodPlan(method.source_free(), used, used)
    else:
      if data is None:
        data = source_stats.open_source_data(cfg.source_data, meta, cfg.tfds_data_dir, cfg.fmnist_dir)
      source_stats.check_labels(method, data, meta["num_classes"])
      described = source_stats.describe(method, data, cfg.batch_size, ckpt_digest, cfg.source_images)
      plans[name] = MethodPlan(method, source_key=source_stats.key(described[1]), described=described)
  return plans, data


def load_source_stats(s: Setup, log) -> None:
  """The source statistics of every method with a unit left to run, from the cache or computed, before the
  first unit: an unreadable source stops the run before any work."""
  cfg = s.cfg
  for name, plan in s.plans.items():
    if plan.described is None or all(u.key in s.done for u in s.units if u.method == name):
      continue
    # The full head (not ImageNet-R's 200-class subset): statistics are of the checkpoint on its own classes.
    # Process 0 computes and caches them first; the others then read its cache (or, on a folder not shared
    # with it, compute the same numbers themselves).
    with s.exchange.main_first():
      plan.stats, desc = source_stats.get(
          plan.method, s.model.clone(class_subset=None), s.params, s.source,
          checkpoint_dir=cfg.checkpoint, output_dir=cfg.output, batch_size=cfg.batch_size, limit=cfg.source_images,
          workers=cfg.workers, progress=cfg.progress and distributed.is_main(), log=log,
          ckpt_digest=s.ckpt_digest, described=plan.described)
    plan.used = source_stats.used_note(desc)


def loader_kind(loader: str, data: Loader) -> str:
  """``loader`` ("threads" or "processes") as given; "auto": worker processes on a GPU or TPU host with 8 or more
  cores, where a thread pool stalls at the GIL (an H200 host's 16 cores: the harness ran a bf16 ViT-B/16 source
  step at 1,487 img/s on threads, 5,109 on processes), and threads on a CPU backend (the cores run the step) or
  where the sources cannot be sent to worker processes."""
  if loader != "auto":
    return loader
  if jax.default_backend() == "cpu" or (os.cpu_count() or 1) < 8:
    return "threads"
  try:
    data.payload()  # kept for the workers: the sources are pickled once
  except UserError:  # e.g. a source holding a lock or an open handle: threads decode it in place
    return "threads"
  return "processes"


def with_preprocessing(method: methods.Method, args: dict, meta: dict) -> methods.Method:
  """A method that augments pixels (CoTTA, ROID, SPA, ...) has ``mean``/``std`` fields to undo the input's
  normalization: they are the checkpoint's unless ``--method-args`` sets them."""
  names = {f.name for f in dataclasses.fields(method)}
  if {"mean", "std"} <= names and not {"mean", "std"} & set(args):
    method = dataclasses.replace(method, mean=tuple(float(v) for v in meta["mean"]),
                                 std=tuple(float(v) for v in meta["std"]))
  return method
