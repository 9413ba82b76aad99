"""The benchmark harness: checkpoint + data + setting -> online adaptation -> result records.

Streams every (seed, method) pair over the segments of the chosen setting, with
one compiled step per method, decoding in a thread pool ahead of the step and
reading each batch's predictions one step late (so the host never waits on the
step it just dispatched). Long runs save the adaptation state, the stream
position and the partial counts every ``checkpoint_every`` batches and on
SIGINT/SIGTERM (orbax for the state, an atomically replaced JSON for the rest);
``resume=True`` continues from there and gives bit-identical results on CPU.

Under `jax.distributed` (several processes, `pcsr_jax.distributed`) every process streams the same global
batches: it decodes only its own rows of each, the processes agree per batch on the unreadable images and on a
stop request, and process 0 alone logs and writes the outputs and the saved progress.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import time
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pcsr_jax import ccc_stream, checkpoint, distributed, engine, methods, results, source_stats
from pcsr_jax.progress import Resume, RunProgress, UnitProgress
from pcsr_jax.data import datasets, imagenet, sources, streams
from pcsr_jax.data.loader import Batch, Loader
from pcsr_jax.errors import UserError
from pcsr_jax.models.vit import ATTENTION_IMPLS, compute_dtype

DATASETS = datasets.NAMES


@dataclasses.dataclass
class RunConfig:
  """Everything a run depends on (stored in results.json)."""

  data: Optional[str]  # a directory; "tfds" for imagenet2012_corrupted; ignored by the built-in fmnist_c
  checkpoint: str
  output: str
  methods: tuple[str, ...] = ("source", "tent", "sar", "pcsr")
  dataset: str = "imagenet_c"
  corruptions: tuple[str, ...] = imagenet.CORRUPTIONS
  severity: float = 5  # an int 1..5; generated data (--clean-data, the built-in benchmark) also takes fractions
  seeds: tuple[int, ...] = (2022, 2023, 2024)
  setting: str = "normal"
  batch_size: int = 64
  limit: Optional[int] = None
  shuffle: bool = True
  eval_order: Optional[str] = None  # None: each method's default
  save_predictions: bool = False
  resume: bool = False
  checkpoint_every: int = 50
  workers: Optional[int] = None
  loader: str = "threads"  # decode in "threads", worker "processes" or "auto" (`loader_kind`); same results
  imbalance_ratio: float = 500000.0
  label_shift_indices: Optional[str] = None
  tfds_data_dir: Optional[str] = None
  # ImageNet-C generated in the stream from clean images (`pcsr_jax.data.generated`) instead of --data: a clean
  # ``<dir>/<wnid>/*.JPEG`` folder or ``tfds[:<name>[:<split>]]``, corrupted with ``corruption_seed``.
  clean_data: Optional[str] = None
  # Where generated data is corrupted: "host" (numpy, the reference), "device" (`corrupt_device`: jitted on the
  # accelerator, JPEG included) or "auto" (the device on a GPU/TPU when every corruption has a device version);
  # `validate` resolves "auto", so results.json says which ran.
  corrupt_on: str = "auto"
  image_list: Optional[str] = None  # visda: the list under --data (None: the official validation list)
  method_args: dict = dataclasses.field(default_factory=dict)  # e.g. {"pcsr": {"lr_dsn": 0.05}}
  progress: bool = True
  # fmnist_c (the built-in benchmark): the first N test images of each corruption, and where they live.
  images_per_corruption: Optional[int] = None
  fmnist_dir: Optional[str] = None
  cache_dir: Optional[str] = None
  corruption_seed: int = 0  # generated data's random corruptions; CCC's walk
  # --setting ccc (`pcsr_jax.ccc_stream`): the baseline accuracy (%) the walk holds, images per walk step, the
  # stream's length (None: CCC's 7.5M, or 15 x --images on the built-in benchmark) and the held-out calibration
  # images.
  ccc_target: float = 20
  ccc_speed: int = 1000
  ccc_length: Optional[int] = None
  ccc_calibration_images: int = 500
  # Clean source data for the methods that need statistics of it (EATA, CFA, FOA): see `pcsr_jax.source_stats`.
  # None: the built-in benchmark uses the Fashion-MNIST training set; elsewhere EATA runs as ETA and
  # CFA/FOA are refused.
  source_data: Optional[str] = None
  source_images: Optional[int] = None  # cap the source images a method's statistics use (records say so)
  # The backbone's compute dtype (`models.vit`): "float32" (the paper numbers) or "bfloat16" (params, losses and
  # optimizer state stay float32); the attention kernel: "matmul", "xla" or "cudnn" (GPU, 16-bit dtype).
  dtype: str = "float32"
  attention: str = "matmul"
  # Rows per pass of the model (`Method.forward`): on a CPU at batch 64, passes of 16 keep the activations in
  # the caches. None: the batch in one pass (the paper numbers; a chunked run differs by float32 rounding).
  row_chunk: Optional[int] = None

  def validate(self) -> None:
    """Every value checked before any work starts: one line naming the flag on the first bad one."""
    if not self.methods:
      raise UserError("--methods: no method given")
    if self.dataset in datasets.REGISTRY and datasets.REGISTRY[self.dataset].has_severity and not self.corruptions:
      raise UserError("--corruptions: no corruption given")
    if not self.seeds or any(not isinstance(s, int) or s < 0 for s in self.seeds):
      raise UserError(f"--seeds: expected non-negative integers, got {','.join(map(str, self.seeds))}")
    if self.workers is not None and self.workers < 1:
      raise UserError(f"--workers: expected a positive integer, got {self.workers}")
    if self.row_chunk is not None and not (isinstance(self.row_chunk, int) and self.row_chunk >= 1):
      raise UserError(f"--row-chunk: expected a positive integer, got {self.row_chunk}")
    if self.loader not in ("threads", "processes", "auto"):
      raise UserError(f"--loader: expected threads, processes or auto, got '{self.loader}'")
    if not (isinstance(self.imbalance_ratio, (int, float)) and math.isfinite(self.imbalance_ratio)
            and self.imbalance_ratio >= 1):
      raise UserError(f"--imbalance-ratio: expected a number >= 1 (1: uniform), got {self.imbalance_ratio}")
    check_output_dir(self.output)
    for m in self.methods:
      if m not in methods.REGISTRY:
        raise UserError(f"--methods: unknown method '{m}': expected some of {', '.join(methods.REGISTRY)}")
    if self.setting not in streams.SETTINGS:
      raise UserError(f"--setting: unknown setting '{self.setting}': expected one of {', '.join(streams.SETTINGS)}")
    spec = datasets.get(self.dataset)
    if self.clean_data is not None:
      if self.dataset != "imagenet_c":
        raise UserError(f"--clean-data generates ImageNet-C: not for --dataset {self.dataset}")
      if self.data is not None:
        raise UserError("--data and --clean-data: give one (the released folders, or clean images to corrupt)")
      sources.parse_images_spec(self.clean_data, "--clean-data")
    elif self.data is None and self.dataset != "fmnist_c":
      raise UserError("--data or --clean-data is required")
    if self.corrupt_on not in ("auto", "host", "device"):
      raise UserError(f"--corrupt-on: expected auto, host or device, got '{self.corrupt_on}'")
    if self.corrupt_on != "host":
      why = self._no_device_path()
      if self.corrupt_on == "device" and why:
        raise UserError(f"--corrupt-on device: {why}")
      if self.corrupt_on == "auto":
        self.corrupt_on = "device" if not why and jax.default_backend() in ("gpu", "tpu") else "host"
    if self.setting == "ccc":
      if not (self.dataset == "fmnist_c" or (self.dataset == "imagenet_c" and self.clean_data)):
        raise UserError("--setting ccc generates its stream from clean images: give --clean-data (ImageNet val), "
                        "or run the built-in benchmark")
      num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
      if not (num(self.ccc_target) and 0 <= self.ccc_target <= 100):
        raise UserError(f"--ccc-target: expected a percentage 0..100 (CCC: 0, 20, 40), got {self.ccc_target}")
      for flag, v in (("--ccc-speed", self.ccc_speed), ("--ccc-length", self.ccc_length),
                      ("--ccc-calibration-images", self.ccc_calibration_images)):
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
          raise UserError(f"{flag}: expected a positive integer, got {v}")
    if self.setting == "gradual" and not spec.has_severity:
      raise UserError(f"--setting gradual: walks corruption severities; --dataset {self.dataset} has none")
    if spec.has_severity:
      spec.check_corruptions(self.corruptions)
      self.severity = check_severity(self.severity, fractional=self.clean_data is not None or spec.generated)
    if self.dataset == "fmnist_c" and self.images_per_corruption is not None and \
        not 1 <= self.images_per_corruption <= 10000:
      raise UserError(f"--images: expected 1 to 10000, got {self.images_per_corruption}")
    compute_dtype(self.dtype)
    if self.attention not in ATTENTION_IMPLS:
      raise UserError(f"--attention: expected one of {', '.join(ATTENTION_IMPLS)}, got '{self.attention}'")
    if self.eval_order not in (None,) + engine.EVAL_ORDERS:
      raise UserError(f"--eval-order: expected one of {', '.join(engine.EVAL_ORDERS)}, got '{self.eval_order}'")
    unknown = sorted(set(self.method_args) - set(methods.REGISTRY))
    if unknown:
      raise UserError(f"method arguments for unknown methods {unknown}")
    for m in self.methods:  # e.g. "perturbed" needs a method with a second (SAM) forward
      method = methods.get(m, **self.method_args.get(m, {}))
      method.check_inputs()  # DePT-G's trained prompts: before any work
      orders = method.eval_orders
      if self.eval_order is not None and self.eval_order not in orders:
        raise UserError(f"--eval-order {self.eval_order}: not available for {m} (it has {', '.join(orders)})")
    if self.batch_size < 1 or (self.limit is not None and self.limit < 1) or self.checkpoint_every < 1:
      raise UserError("--batch-size, --limit and --checkpoint-every must be positive")
    if self.source_images is not None and (not isinstance(self.source_images, int) or self.source_images < 1):
      raise UserError(f"--source-images: expected a positive integer, got {self.source_images}")
    if self.source_data is not None:
      source_stats.check_spec(self.source_data)
    if self.source_data is None and self.dataset == "fmnist_c":
      self.source_data = "fmnist-train"  # the built-in benchmark's clean source: its model's training set
    if self.source_data is None:
      for m in self.methods:
        method = methods.get(m, **self.method_args.get(m, {}))
        if method.uses_source_data() and method.source_free() is None:
          raise UserError(f"--source-data: {m} needs clean source data (a clean ImageNet folder, or tfds) for "
                          f"its statistics; none given")
    if self.setting == "bs1" and self.batch_size != 1:
      self.batch_size = 1  # the bs1 setting *is* batch size 1


  def _no_device_path(self) -> str:
    """Why this run's data cannot be corrupted on the device ("" if it can)."""
    from pcsr_jax.data import corrupt_device

    if not self.clean_data:
      return "the device path corrupts --clean-data's images; give --clean-data"
    if self.setting in ("mix_shifts", "ccc"):
      return f"--setting {self.setting} mixes corruptions within a batch; the device path takes one per batch"
    host = [c for c in self.corruptions if c not in corrupt_device.DEVICE_CORRUPTIONS]
    if host:
      return f"{', '.join(host)} {'has' if len(host) == 1 else 'have'} no device version (host only)"
    if distributed.is_multiprocess():
      return "one process only (a multi-process run corrupts on the host)"
    return ""


def check_severity(severity, fractional: bool) -> float:
  """``--severity``: an integer 1..5 for released data; generated data also takes a fraction in (0, 5] (the
  tables interpolated, `corruptions.params`). An integral value comes back as an int (records and file names
  then read ``5``, not ``5.0``)."""
  ok = isinstance(severity, (int, float)) and not isinstance(severity, bool) and math.isfinite(severity)
  if ok and float(severity).is_integer():
    severity = int(severity)
  if fractional:
    if not (ok and 0 < severity <= 5):
      raise UserError(f"--severity: expected a number in (0, 5], got {severity}")
  elif not (ok and isinstance(severity, int) and 1 <= severity <= 5):
    raise UserError(f"--severity: expected 1 to 5 (fractions need generated data: --clean-data), got {severity}")
  return severity


def check_output_dir(path: str) -> None:
  """The output directory must be creatable and writable (checked before any work, not after a method ran)."""
  if not path:
    raise UserError("--output: empty path")
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"--output {path}: exists and is not a directory")
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_test_{socket.gethostname()}_{os.getpid()}")  # unique across hosts
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"--output {path}: not writable ({e.strerror or type(e).__name__})") from None


def versions() -> dict[str, str]:
  import flax
  import jax
  import optax

  import pcsr_jax

  return dict(pcsr_jax=pcsr_jax.__version__, jax=jax.__version__, flax=flax.__version__, optax=optax.__version__,
              numpy=np.__version__, python=sys.version.split()[0], devices=str(jax.devices()))


class _Stop:
  """SIGINT/SIGTERM set a flag; the loop saves its progress at the next batch and exits."""

  def __init__(self):
    self.requested = False

  def __enter__(self):
    self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return self

  def _handler(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


@dataclasses.dataclass
class _Setup:
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
  resume: "Resume"
  progress: RunProgress
  config_json: dict
  decode_ips: float
  exchange: distributed.Exchange  # the processes' per-batch agreement (`pcsr_jax.distributed`)
  meta: dict = dataclasses.field(default_factory=dict)
  plans: dict = dataclasses.field(default_factory=dict)  # method name -> _MethodPlan
  source: Optional[source_stats.SourceData] = None  # --source-data, opened before any work if a method uses it
  ckpt_digest: str = ""  # `checkpoint.params_digest` of the checkpoint: in the resume key and the stats' key
  ccc: Optional[dict] = None  # --setting ccc: its calibration and walk, for results.json
  corrupters: Optional[list] = None  # --corrupt-on device: one `corrupt_device.BatchCorrupter` per source


@dataclasses.dataclass
class _MethodPlan:
  """A method of the run as settled before any work: what runs (EATA's source-free form without
  ``--source-data``), its source statistics and what its records say about them, and ``source_key``, what its
  units' statistics depend on (`source_stats.key`; "none..." without statistics), which ``--resume`` must
  find unchanged for a unit it continues or keeps."""

  method: methods.Method
  used: str = "none"
  source_key: str = "none"
  described: Optional[tuple] = None  # `source_stats.describe`'s (indices, description)
  stats: Optional[dict] = None


def run(cfg: RunConfig, log=print) -> dict:
  """Runs the experiment; returns ``{'records', 'curves', 'skipped', ...}`` and writes the outputs.

  Under `jax.distributed` every process calls this with the same config; only process 0 logs and writes."""
  if not distributed.is_main():
    log = lambda *a, **k: None
  setup = _setup(cfg, log)
  try:
    with _Stop() as stop:
      for seed in cfg.seeds:
        if not _run_seed(setup, seed, stop, log):
          log(f"interrupted: progress saved to {setup.resume.path}; rerun with --resume to continue")
          raise SystemExit(130)
  finally:
    setup.loader.close()  # the decode processes, if any
  return _write_outputs(setup, log)


def _setup(cfg: RunConfig, log) -> _Setup:
  """Validates the config, loads the checkpoint and the data, and loads or starts the progress."""
  cfg.validate()
  spec = datasets.get(cfg.dataset)
  model, params, meta = checkpoint.load(cfg.checkpoint, kind="vit")
  model = model.clone(dtype=compute_dtype(cfg.dtype), attention=cfg.attention)
  ckpt_digest = checkpoint.params_digest(params)  # once: the resume key and every statistics' key use it
  exchange = distributed.Exchange()
  preprocess = spec.preprocess(meta)
  ccc_record = None
  with exchange.main_first():  # the built-in benchmark's cache (and CCC's calibration) is filled by one process
    if cfg.setting == "ccc":
      src, ccc_record = ccc_stream.build(cfg, model, params, meta, preprocess, ckpt_digest, log)
      domains = [("ccc", src)]
    else:
      domains = _open_domains(spec, cfg, log)
  subset = spec.class_subset()
  for name, src in domains:
    sources.check_classes(src, meta["num_classes"], subset, spec.where(cfg, streams.split_domain(name, 0)[0]))
  relabel = None  # ImageNet-R/-A: labels become positions in the 200-class subset of the logits
  num_classes = meta["num_classes"]
  if subset is not None:
    model = model.clone(class_subset=tuple(int(c) for c in subset))
    relabel = np.full(meta["num_classes"], -1, np.int64)
    relabel[subset] = np.arange(len(subset))
    num_classes = len(subset)
  plans, source = _plan_methods(cfg, meta, ckpt_digest, log)  # opens and checks --source-data, if used
  srcs = [s for _, s in domains]
  names = [n for n, _ in domains]
  corrupters = None
  if cfg.corrupt_on == "device":  # clean crops decoded here, corrupted on the accelerator (`_batches`)
    from pcsr_jax.data import corrupt_device

    corrupters = [corrupt_device.BatchCorrupter(s.corruption, s.severity, s.seed, preprocess.img_size) for s in srcs]
    loader = Loader(srcs, _crop_as_is, cfg.batch_size, workers=cfg.workers)
  else:
    loader = Loader(srcs, preprocess.to_uint8, cfg.batch_size, workers=cfg.workers)  # uint8: normalized on device
  kind = loader_kind(cfg.loader, loader)
  loader.processes = kind == "processes"
  decode_ips = loader.throughput(min(256, len(srcs[0])))
  origin = f"generated from the clean images {cfg.clean_data}" if cfg.clean_data else f"from {cfg.data}"
  if cfg.clean_data:
    origin += f", corrupted on the {cfg.corrupt_on}"
  log(f"data: {cfg.dataset} {origin}: {len(domains)} domain(s), {sum(len(s) for s in srcs):,} images; "
      f"decode + preprocess {decode_ips:.0f} img/s ({loader.workers} {kind})")

  os.makedirs(cfg.output, exist_ok=True)
  resume = Resume(cfg.output)
  config_json = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
  key = _config_key(config_json, ckpt_digest)
  data_key = _data_key(srcs)
  progress = resume.load() if cfg.resume else None
  _check_same_progress(exchange, progress, resume.path)
  if cfg.resume and progress is None:
    log(f"--resume: no saved progress in {resume.dir}; starting from the beginning")
  if progress is not None:
    _check_resumable(progress, key, data_key, plans, resume.path, cfg.checkpoint, log)
  if progress is None:
    if distributed.is_main():  # the only process that writes in the output folder
      if os.path.isfile(resume.path):
        log(f"discarding the saved progress in {resume.dir} (pass --resume to continue it)")
      resume.clear()
      _remove_outputs(cfg.output, log)
    progress = RunProgress(config_key=key, data_key=data_key)
  elif progress.unit or progress.done:
    u = progress.unit
    log(f"resuming from {resume.path}: {len(progress.done)} runs done" +
        (f", {u.key} at segment {u.segment} batch {u.batch}" if u else ""))
  setup = _Setup(cfg, spec, model, params, num_classes, names, srcs, relabel, loader, resume, progress,
                 config_json, decode_ips, exchange, meta, plans, source, ckpt_digest, ccc_record, corrupters)
  _load_source_stats(setup, log)
  return setup


def _crop_as_is(img) -> np.ndarray:
  """The device path's loader preprocessing: `generated.CleanCrops` already gives the release's 224 px crop."""
  return np.asarray(img, np.uint8)


def _open_domains(spec: datasets.DatasetSpec, cfg: RunConfig, log) -> list:
  """The run's ``[(domain name, source)]``: one per corruption, or for the gradual setting one per corruption
  and severity 1..5 (`streams.gradual_domain`), corruption after corruption."""
  if cfg.setting != "gradual":
    return spec.open(cfg, log)
  by_severity = {s: spec.open(dataclasses.replace(cfg, severity=s), log) for s in streams.SEVERITIES}
  return [(streams.gradual_domain(c, s), by_severity[s][k][1]) for k, c in enumerate(cfg.corruptions)
          for s in streams.SEVERITIES]


def _columns(setup: _Setup) -> list[str]:
  """The table's and plots' columns: the domains, or for the gradual setting the corruptions (each the mean of
  its 9 passes)."""
  return list(setup.cfg.corruptions) if setup.cfg.setting == "gradual" else setup.names


def _plan_methods(cfg: RunConfig, meta: dict, ckpt_digest: str, log
                  ) -> tuple[dict[str, _MethodPlan], Optional[source_stats.SourceData]]:
  """Each method as it will run, and ``--source-data`` opened and checked (classes against the head for a
  method that reads labels) if a method uses it: before any work, so that a bad source stops the run before
  its first method, not when the method that needs it comes up."""
  plans, data = {}, None
  for name in cfg.methods:
    args = cfg.method_args.get(name, {})
    method = _with_preprocessing(methods.get(name, **args), args, meta)
    if not method.uses_source_data():
      plans[name] = _MethodPlan(method)
    elif cfg.source_data is None:  # `RunConfig.validate` refused the methods without a source-free form
      used = f"none: source-free form ({method.source_free_note()})"
      log(f"{name}: no --source-data; running its source-free form ({method.source_free_note()})")
      plans[name] = _MethodPlan(method.source_free(), used, used)
    else:
      if data is None:
        data = source_stats.open_source_data(cfg.source_data, meta, cfg.tfds_data_dir, cfg.fmnist_dir)
      source_stats.check_labels(method, data, meta["num_classes"])
      described = source_stats.describe(method, data, cfg.batch_size, ckpt_digest, cfg.source_images)
      plans[name] = _MethodPlan(method, source_key=source_stats.key(described[1]), described=described)
  return plans, data


def _load_source_stats(setup: _Setup, log) -> None:
  """The source statistics of every method with a unit left to run, from the cache or computed, before the
  first unit: an unreadable source stops the run before any work."""
  cfg = setup.cfg
  for name, plan in setup.plans.items():
    if plan.described is None or all(f"{name}/seed{s}" in setup.progress.done for s in cfg.seeds):
      continue
    # The full head (not ImageNet-R's 200-class subset): statistics are of the checkpoint on its own classes.
    # Process 0 computes and caches them first; the others then read its cache (or, on a folder not shared
    # with it, compute the same numbers themselves).
    with setup.exchange.main_first():
      plan.stats, desc = source_stats.get(
          plan.method, setup.model.clone(class_subset=None), setup.params, setup.source,
          checkpoint_dir=cfg.checkpoint, output_dir=cfg.output, batch_size=cfg.batch_size, limit=cfg.source_images,
          workers=cfg.workers, progress=cfg.progress and distributed.is_main(), log=log,
          ckpt_digest=setup.ckpt_digest, described=plan.described)
    plan.used = source_stats.used_note(desc)


def _check_resumable(progress: RunProgress, key: str, data_key: str, plans: dict, path: str,
                     checkpoint_dir: str, log) -> None:
  """Saved progress is continued only under the configuration, checkpoint params and data it was made with.

  A unit it holds (finished or open) that would now get other source statistics (``--source-data`` corrected,
  its images repaired, ``--source-images`` changed) runs again from its start, its records dropped: its
  statistics are not the run's any more. Units that used none, or the same, keep their records, so that
  correcting ``--source-data`` loses no other work."""
  if progress.config_key != key:
    differ = _config_diff(progress.config_key, key)
    if "checkpoint_params" in differ:
      raise UserError(f"{path}: the params of --checkpoint {checkpoint_dir} changed since the progress was saved "
                      f"(replaced or re-converted); rerun without --resume to start over")
    raise UserError(f"{path}: saved progress is from a different configuration"
                    f"{' (' + ', '.join(differ) + ' differ)' if differ else ''}; drop --resume or use another --output")
  if progress.data_key != data_key:
    raise UserError(f"{path}: the data changed since the progress was saved (images added, removed or "
                    f"relabelled); rerun without --resume to start over")
  for unit in progress.done + ([progress.unit.key] if progress.unit else []):
    saved, now = progress.source_keys.get(unit), plans[unit.rsplit("/seed", 1)[0]].source_key
    if saved != now:
      why = ("it ran without --source-data" if str(saved).startswith("none") else
             "this run has no --source-data" if now.startswith("none") else
             "--source-data, --source-images or the source images changed")
      log(f"{unit}: its source statistics would differ from those it ran with ({why}); running it again from "
          f"the start")
      _forget_unit(progress, unit)


def _forget_unit(progress: RunProgress, unit: str) -> None:
  """Drops what ``unit`` (``<method>/seed<s>``) produced from ``progress``, so that it runs again."""
  method, seed = unit.rsplit("/seed", 1)
  progress.records = [r for r in progress.records if (r["method"], str(r["seed"])) != (method, seed)]
  progress.curves.pop(unit, None)
  progress.throughput.pop(unit, None)
  progress.source_keys.pop(unit, None)
  progress.done = [u for u in progress.done if u != unit]
  if progress.unit is not None and progress.unit.key == unit:
    progress.unit = None


def _config_diff(saved: str, now: str) -> list[str]:
  """The settings in which two `_config_key`s differ (empty if ``saved`` is not one)."""
  try:
    a, b = json.loads(saved), json.loads(now)
  except ValueError:
    return []
  if not isinstance(a, dict):
    return []
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


_PREDICTIONS = re.compile(r"_.+_(\d+(\.\d+)?|None)_seed\d+\.npz$")  # `_predictions_file`'s names after the method's


def _predictions_file(out: str, method: str, domain: str, severity: float, seed: int) -> str:
  return os.path.join(out, "predictions", f"{method}_{domain}_{severity}_seed{seed}.npz")


def _remove_outputs(out: str, log) -> None:
  """A fresh run owns its output folder's results: it removes those of an earlier run (results, table, plots and
  predictions files), so that none is taken for its own: a stale "complete" result, or the predictions of a
  method it does not run. Only files named as the harness names them go; the user's other files stay."""
  gone = [os.path.join(out, n) for n in ("results.json", "results.csv", "table.md") + results.PLOTS]
  pred_dir = os.path.join(out, "predictions")
  if os.path.isdir(pred_dir):
    gone += [os.path.join(pred_dir, f) for f in sorted(os.listdir(pred_dir))
             if any(f.startswith(m) and _PREDICTIONS.fullmatch(f[len(m):]) for m in methods.REGISTRY)]
  gone = [p for p in gone if os.path.isfile(p)]
  for p in gone:
    os.remove(p)
  if any(os.path.dirname(p) == pred_dir for p in gone):
    log(f"removed {sum(os.path.dirname(p) == pred_dir for p in gone)} predictions files of an earlier run from "
        f"{pred_dir}")


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


def _check_same_progress(exchange: distributed.Exchange, progress: Optional[RunProgress], path: str) -> None:
  """Every process must resume from the same saved progress: the output folder has to be shared by all hosts."""
  mine = "none" if progress is None else hashlib.sha256(
      json.dumps(progress.to_json(), sort_keys=True).encode()).hexdigest()
  seen = exchange.allgather(mine)
  if len(set(seen)) > 1:
    odd = next(p for p, h in enumerate(seen) if h != seen[0])
    raise UserError(f"{path}: process {odd} sees other saved progress than process 0; --output must be a folder "
                    f"shared by every process")


def _run_seed(setup: _Setup, seed: int, stop: "_Stop", log) -> bool:
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


def _with_preprocessing(method: methods.Method, args: dict, meta: dict) -> methods.Method:
  """A method that augments pixels (CoTTA, ROID, SPA, ...) has ``mean``/``std`` fields to undo the input's
  normalization: they are the checkpoint's unless ``--method-args`` sets them."""
  names = {f.name for f in dataclasses.fields(method)}
  if {"mean", "std"} <= names and not {"mean", "std"} & set(args):
    method = dataclasses.replace(method, mean=tuple(float(v) for v in meta["mean"]),
                                 std=tuple(float(v) for v in meta["std"]))
  return method


def _write_outputs(setup: _Setup, log) -> dict:
  cfg, progress = setup.cfg, setup.progress
  records = progress.records
  # Nothing claims completion unless every planned (method, seed, domain) record exists.
  have = {(r["method"], r["seed"], r.get("domain", r["corruption"])) for r in records}
  missing = [(m, s, d) for s in cfg.seeds for m in cfg.methods for d in setup.names if (m, s, d) not in have]
  if missing:
    m, s, d = missing[0]
    lost = sum(n.startswith(f"{d}/") for n in progress.skipped)
    raise UserError(f"no image of {d} was evaluated for {m} seed {s} ({lost} unreadable, "
                    f"{len(missing)} of {len(cfg.seeds) * len(cfg.methods) * len(setup.names)} planned results "
                    f"missing): nothing written")
  tbl = results.table(records, _columns(setup), cfg.methods)
  out = dict(records=records, curves=progress.curves, skipped=progress.skipped, table=tbl,
             decode_images_per_s=setup.decode_ips, throughput=progress.throughput)
  if not distributed.is_main():  # one set of outputs: process 0's
    return out
  extra = dict(versions=versions(), skipped=progress.skipped, decode_images_per_s=setup.decode_ips,
               throughput=progress.throughput, curves=progress.curves)
  if distributed.is_multiprocess():
    extra["processes"] = jax.process_count()
  if setup.ccc is not None:
    extra["ccc"] = setup.ccc
  results.write_json(os.path.join(cfg.output, "results.json"), records, setup.config_json, extra)
  results.write_csv(os.path.join(cfg.output, "results.csv"), records)
  with open(os.path.join(cfg.output, "table.md"), "w") as f:
    f.write(tbl)
  plots = results.plot(cfg.output, records, progress.curves, _columns(setup), cfg.methods)
  setup.resume.clear()
  log(tbl)
  if setup.spec.open_set:  # VisDA-2021: the papers count every sample; the official metric known classes only
    for m in cfg.methods:
      recs = [r for r in records if r["method"] == m]
      log(f"{m}: accuracy over all samples {100 * np.mean([r['accuracy'] for r in recs]):.2f}%, over "
          f"known-class samples {100 * np.mean([r['accuracy_known'] for r in recs]):.2f}%")
  if progress.skipped:
    log(f"skipped {len(progress.skipped)} unreadable images (listed in results.json)")
  log(f"wrote {cfg.output}/results.json, results.csv, table.md, {', '.join(os.path.basename(p) for p in plots)}")
  return out


def _data_key(srcs: list) -> str:
  """A digest of every stream item in order (name and label), and of how generated data is made (the
  generator's version, corruption, severity and seed: `generated.CorruptedSource.describe`): what --resume
  must find unchanged."""
  h = hashlib.sha256()
  for src in srcs:
    h.update(f"{len(src)} {getattr(src, 'describe', '')}\n".encode())
    base = getattr(src, "clean", src)  # generated data: the clean images' names (CCC's 7.5M come from them)
    h.update("\n".join(base.names).encode())
    h.update(np.asarray(base.labels, np.int64).tobytes())
  return h.hexdigest()


def _config_key(config_json: dict, ckpt_digest: str) -> str:
  """What ``--resume`` must find unchanged in the whole run: the settings that change results, and the
  checkpoint's params (a checkpoint replaced at the same path is another model). ``--source-data`` and
  ``--source-images`` are checked per unit instead (`_MethodPlan.source_key`): units that used no source
  statistics keep their records when they change."""
  keep = {k: v for k, v in config_json.items()
          if k not in ("resume", "progress", "workers", "loader", "checkpoint_every", "source_data", "source_images")}
  return json.dumps(dict(keep, checkpoint_params=ckpt_digest), sort_keys=True)


class _Bar:
  """A tqdm bar on a terminal; elsewhere (CI, nohup, a log file) one line per segment instead."""

  def __init__(self, cfg: RunConfig, key: str, total: int, initial: int, log):
    from tqdm import tqdm

    self.key, self.log = key, log
    show = cfg.progress and distributed.is_main()
    self.tty = show and sys.stderr.isatty()
    self.lines = show and not self.tty
    self.bar = tqdm(total=total, initial=initial, desc=key, disable=not self.tty, leave=False, file=sys.stderr)

  def update(self, unit: UnitProgress, seconds: float) -> None:
    self.bar.update(1)
    if self.tty and unit.seen:
      self.bar.set_postfix(acc=f"{100 * unit.correct / unit.seen:.1f}", img_s=f"{unit.seen / seconds:.1f}")

  def segment(self, name: str, unit: UnitProgress) -> None:
    if self.lines and unit.seen:
      self.log(f"{self.key} {name}: running accuracy {100 * unit.correct / unit.seen:.1f}% over {unit.seen:,} "
               f"images, {unit.images_per_s:.1f} img/s")

  def close(self) -> None:
    self.bar.close()


def _run_unit(setup: _Setup, key: str, method_name: str, seed: int, adapter: engine.Adapter, segments: list,
              stop: "_Stop", log, source_used: str = "none") -> bool:
  """One method and seed over all segments. Returns False when interrupted (progress saved)."""
  cfg, progress = setup.cfg, setup.progress
  unit = progress.unit if progress.unit and progress.unit.key == key else None
  state = None
  if unit is not None:
    template = adapter.state_to_host(adapter.init_state())
    state = adapter.state_from_host(setup.resume.restore_state(progress, template))
  else:
    unit = UnitProgress(key=key)
  curve = progress.curves.setdefault(key, {"seen": [], "accuracy": []})
  n_batches = [-(-len(s.indices) // cfg.batch_size) for s in segments]
  bar = _Bar(cfg, key, sum(n_batches), sum(n_batches[:unit.segment]) + unit.batch, log)
  batches_since_save = 0
  def score(preds, finite, batch, domain: str, at_batch: int) -> None:
    if not bool(finite):  # read one step late, like the predictions
      raise UserError(f"{key} diverged on {domain} at batch {at_batch}: non-finite logits or adapted parameters "
                      f"(lower its learning rate in --method-args)")
    unit.account(preds, batch, setup.names, setup.relabel, setup.num_classes, curve)

  predict = _predictor(adapter.mesh)
  for si in range(unit.segment, len(segments)):
    seg = segments[si]
    if (seg.reset and unit.batch == 0) or state is None:
      state = adapter.reset(state)
    t_seg = time.perf_counter()
    pending = None
    for batch, placed, stop_now in _batches(setup, adapter, seg, unit.batch, stop):
      progress.skipped += [n for n in (f"{seg.name}/{n}" for n in batch.skipped) if n not in progress.skipped]
      unit.skipped += len(batch.skipped)
      if placed is not None:
        state, logits, metrics = adapter.step_placed(state, placed)
        preds = predict(logits)  # stays on device; read one step later
        if pending is not None:
          score(*pending)
        pending = (preds, metrics["finite"], batch, seg.name, unit.batch)
      unit.batch += 1
      batches_since_save += 1
      bar.update(unit, unit.total_seconds + unit.seconds + time.perf_counter() - t_seg)
      if stop_now or batches_since_save >= cfg.checkpoint_every:
        if pending is not None:
          score(*pending)
          pending = None
        unit.add_time(time.perf_counter() - t_seg)
        t_seg = time.perf_counter()
        progress.unit = unit
        if distributed.is_main():
          setup.resume.save(progress, adapter.state_to_host(state))
        batches_since_save = 0
        if stop_now:
          bar.close()
          return False
    if pending is not None:
      score(*pending)
    unit.add_time(time.perf_counter() - t_seg)
    _record_segment(setup, unit, seg, method_name, seed, adapter.eval_order, int(state.resets), source_used)
    unit.close_segment()
    bar.segment(seg.name, unit)
  bar.close()
  progress.throughput[key] = dict(images=unit.seen, seconds=unit.total_seconds, images_per_s=unit.images_per_s)
  progress.done.append(key)
  progress.unit = None
  if distributed.is_main():
    setup.resume.save(progress)
  log(f"{key}: accuracy {100 * unit.correct / max(unit.seen, 1):.2f}% over {unit.seen:,} images, "
      f"{unit.images_per_s:.1f} img/s end to end")
  return True


@functools.lru_cache(maxsize=None)
def _predictor(mesh) -> Any:
  """logits -> the predicted classes of the whole batch on every device, so that every process can read them
  (under `jax.distributed` the logits' rows are spread over the processes); dispatched without waiting."""
  return jax.jit(lambda logits: logits.argmax(-1), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _batches(setup: _Setup, adapter: engine.Adapter, seg, start_batch: int, stop: "_Stop"):
  """``(batch, placed, stop_now)`` per global batch of a segment from ``start_batch`` on.

  ``batch`` has the labels, names and tags of the batch's readable images (the same on every process),
  ``placed`` its images on the mesh (None when none was readable), ``stop_now`` whether to save and stop after
  it. One process decodes the whole batch; under `jax.distributed` see `_distributed_batches`."""
  if not distributed.is_multiprocess():
    for b in setup.loader.batches(seg.source_ids, seg.indices, start_batch=start_batch):
      placed = adapter.place(b.images) if len(b.labels) else None
      if placed is not None and setup.corrupters is not None:  # one source per batch (`_no_device_path`)
        sid = int(b.tags[0])
        placed = (setup.corrupters[sid](placed[0], setup.srcs[sid].keys(b.names)), placed[1])
      yield b, placed, stop.requested
    return
  yield from _distributed_batches(setup, adapter, seg, start_batch, stop)


def _distributed_batches(setup: _Setup, adapter: engine.Adapter, seg, start_batch: int, stop: "_Stop"):
  """`_batches` over several processes, giving exactly the one-process batches.

  This process decodes the batch's items at its rows ``lo..hi`` (`Adapter.local_rows`). The processes then
  exchange which of those were readable and whether a stop was requested: every process learns the batch's
  readable items, compacts them as one process would (unreadable items dropped, the rest moved up, padding
  at the end), and places the images of its rows of the compacted batch. An image that moved into its rows from
  another process's share (after an unreadable one) is decoded here again; without unreadable images nothing
  moves. All processes stop after the same batch: the first whose exchange carries a stop request.
  """
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


def _record_segment(setup: _Setup, unit: UnitProgress, seg, method_name: str, seed: int, eval_order: str,
                    resets: int, source_used: str = "none") -> None:
  """Records the segment's per-domain accuracies (for mix_shifts: every corruption in the mix).

  ``resets`` counts the method's in-step recoveries (SAR's EMA reset) since its state was last initialized.
  On an open-set dataset (VisDA-2021) ``accuracy`` counts every sample, as the papers do, and
  ``accuracy_known`` only those of a known class, the official metric.
  """
  cfg = setup.cfg
  for tag in ([seg.name] if seg.name != "mix" else setup.names):
    counts, preds = unit.take_domain(tag)
    if counts is None:
      continue
    correct, total, correct_known, known = counts
    corruption, severity = streams.split_domain(tag, None if cfg.setting == "ccc" else cfg.severity)
    rec = dict(method=method_name, setting=cfg.setting, corruption=corruption, severity=severity, seed=seed,
               eval_order=eval_order, accuracy=correct / max(total, 1), num_samples=total,
               num_skipped=unit.skipped, seconds=unit.seconds, resets=resets, source_data=source_used)
    stem = corruption
    if tag != corruption:  # gradual: a corruption's severities, each met twice but 5: named by stream segment
      rec.update(domain=tag, segment=unit.segment)
      stem = f"{corruption}-segment{unit.segment}"
    if setup.spec.open_set:
      rec.update(accuracy_known=correct_known / max(known, 1), num_known=known)
    setup.progress.records.append(rec)
    if cfg.save_predictions and distributed.is_main():
      fn, lab, pred = preds
      path = _predictions_file(cfg.output, method_name, stem, severity, seed)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      np.savez(path, file_names=np.asarray(fn), labels=np.asarray(lab, np.int32),
               predictions=np.asarray(pred, np.int32))
