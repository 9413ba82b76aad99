"""A run's configuration (`RunConfig`): everything its results depend on, stored in results.json, and its
validation: every value checked before any work starts, one line naming the flag on the first bad one."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from typing import Optional, Union

import jax

from pcsr_jax import ccc_stream, distributed, engine, method_names, methods, realtime, source_stats
from pcsr_jax.data import datasets, imagenet, sources, streams
from pcsr_jax.data.generators import corruptions as corr
from pcsr_jax.errors import UserError
from pcsr_jax.models.vit import ATTENTION_IMPLS, compute_dtype


EXECUTORS = ("threads", "ray")
# The largest seed (`--seeds`): with 64-bit types off (JAX's default, the runs'), ``jax.random.key`` keeps the low
# 32 bits of a seed below 2**63 (2**32 gives seed 0's key) and raises OverflowError from 2**63 on.
MAX_SEED = 2**32 - 1


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
  # ImageNet-C generated in the stream from clean images (`data.generators.generated`) instead of --data: a clean
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
  # optimizer state stay float32); the attention kernel: "auto" (per platform and dtype: `vit.attention_for`),
  # "matmul", "xla" or "cudnn" (GPU, 16-bit dtype).
  dtype: str = "float32"
  attention: str = "auto"
  # Rows per pass of the model (`Method.forward`): on a CPU at batch 64, passes of 16 keep the activations in
  # the caches. None: the batch in one pass (the paper numbers; a chunked run differs by float32 rounding).
  row_chunk: Optional[int] = None
  # How the run's units run (`pcsr_jax.units`): devices per unit, a unit per group at once (None: one per device
  # on a GPU/TPU host with more units than devices, else all of them in one group); ``executor`` "threads" (this
  # host's device groups) or "ray" (an actor per device group of a Ray cluster, `pcsr_jax.ray_units`) at
  # ``ray_address`` (None: a local Ray instance on this host), waiting up to ``ray_timeout`` seconds for it to
  # start or answer (None: `ray_cluster.START_TIMEOUT_S` / `CONNECT_TIMEOUT_S`).
  devices_per_unit: Optional[int] = None
  executor: str = "threads"
  ray_address: Optional[str] = None
  ray_timeout: Optional[float] = None
  # The realistic online protocol (`pcsr_jax.realtime`): the stream's speed ("source": one batch per Source
  # forward on this device; a number: images per second; None: unlimited time), each method's relative cost C
  # where it is fixed (else measured), and the timed steps per method after compilation (`pcsr_jax.cost`: every
  # run's cost table, and C).
  realtime: Union[None, str, float] = None
  realtime_cost: dict = dataclasses.field(default_factory=dict)
  cost_batches: int = 5

  def validate(self) -> None:
    """Every value checked before any work starts: one line naming the flag on the first bad one. Resolves
    ``corrupt_on='auto'``, an integral severity to an int, the built-in benchmark's source data and the bs1
    setting's batch size, so that results.json says what ran."""
    self._check_lists()
    self._check_counts()
    check_output_dir(self.output)
    self._check_data()
    self._check_ccc_values()  # whether or not the setting is ccc: a value is checked where it is given
    self._check_model()
    self._check_source()
    self._check_realtime()
    if self.setting == "bs1" and self.batch_size != 1:
      self.batch_size = 1  # the bs1 setting *is* batch size 1

  def _check_lists(self) -> None:
    """Methods, corruptions and seeds: given, known, each once."""
    if not self.methods:
      raise UserError("--methods: no method given")
    if self.dataset in datasets.REGISTRY and datasets.REGISTRY[self.dataset].has_severity and not self.corruptions:
      raise UserError("--corruptions: no corruption given")
    if not self.seeds or any(not isinstance(s, int) or not 0 <= s <= MAX_SEED for s in self.seeds):
      raise UserError(f"--seeds: expected integers from 0 to {MAX_SEED}, got {','.join(map(str, self.seeds))}")
    for flag, values in (("--methods", self.methods), ("--corruptions", self.corruptions), ("--seeds", self.seeds)):
      twice = [v for k, v in enumerate(values) if v in values[:k]]
      if twice:  # it would run twice and weigh twice in the average
        raise UserError(f"{flag}: {twice[0]} given twice; give each once")
    method_names.check(self.methods, tuple(methods.REGISTRY))
    if self.setting not in streams.SETTINGS:
      raise UserError(f"--setting: unknown setting '{self.setting}': expected one of {', '.join(streams.SETTINGS)}")

  def _check_counts(self) -> None:
    """The counts and the choices of how to run (workers, loader, row chunks, batches, the label-shift ratio)."""
    if self.workers is not None and self.workers < 1:
      raise UserError(f"--workers: expected a positive integer, got {self.workers}")
    if self.row_chunk is not None and not (isinstance(self.row_chunk, int) and self.row_chunk >= 1):
      raise UserError(f"--row-chunk: expected a positive integer, got {self.row_chunk}")
    if self.loader not in ("threads", "processes", "auto"):
      raise UserError(f"--loader: expected threads, processes or auto, got '{self.loader}'")
    if self.executor not in EXECUTORS:
      raise UserError(f"--executor: expected {' or '.join(EXECUTORS)}, got '{self.executor}'")
    if self.executor == "ray" and distributed.is_multiprocess():
      raise UserError("--executor ray: Ray's actors run the units; --coordinator/--distributed run one job over "
                      "every process (give one or the other)")
    for flag, value in (("--ray-address", self.ray_address), ("--ray-timeout", self.ray_timeout)):
      if value is not None and self.executor != "ray":
        raise UserError(f"{flag}: for --executor ray")
    if self.ray_timeout is not None and not (isinstance(self.ray_timeout, (int, float)) and
                                             math.isfinite(self.ray_timeout) and self.ray_timeout > 0):
      raise UserError(f"--ray-timeout: expected a positive number of seconds, got {self.ray_timeout}")
    if self.executor == "ray":  # before any work: Ray installed, the cluster's address well formed and open
      from pcsr_jax import ray_cluster

      ray_cluster.require_ray(self.ray_address, timeout_s=self.ray_timeout)
      if self.ray_address is not None:
        ray_cluster.check_address(self.ray_address)
    if not (isinstance(self.imbalance_ratio, (int, float)) and math.isfinite(self.imbalance_ratio)
            and self.imbalance_ratio >= 1):
      raise UserError(f"--imbalance-ratio: expected a number >= 1 (1: uniform), got {self.imbalance_ratio}")
    for flag, v in (("--batch-size", self.batch_size), ("--limit", self.limit),
                    ("--checkpoint-every", self.checkpoint_every), ("--source-images", self.source_images),
                    ("--devices-per-unit", self.devices_per_unit)):
      if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise UserError(f"{flag}: expected a positive integer, got {v}")

  def _check_data(self) -> None:
    """Where the images come from (released, generated from clean images, built in), where they are corrupted,
    and the corruptions, severity and seed of generated data."""
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
    if self.setting == "ccc" and not (self.dataset == "fmnist_c" or (self.dataset == "imagenet_c" and
                                                                     self.clean_data)):
      raise UserError("--setting ccc generates its stream from clean images: give --clean-data (ImageNet val), "
                      "or run the built-in benchmark")
    corr.check_seed(self.corruption_seed)
    if self.setting == "gradual" and not spec.has_severity:
      raise UserError(f"--setting gradual: walks corruption severities; --dataset {self.dataset} has none")
    if spec.has_severity:
      spec.check_corruptions(self.corruptions)
      self.severity = check_severity(self.severity, fractional=self.clean_data is not None or spec.generated)
    if self.dataset == "fmnist_c" and self.images_per_corruption is not None and \
        not 1 <= self.images_per_corruption <= 10000:
      raise UserError(f"--images: expected 1 to 10000, got {self.images_per_corruption}")

  def _check_model(self) -> None:
    """How the model runs (dtype, attention kernel) and each method's arguments and eval order."""
    compute_dtype(self.dtype)
    if self.attention not in ATTENTION_IMPLS:
      raise UserError(f"--attention: expected one of {', '.join(ATTENTION_IMPLS)}, got '{self.attention}'")
    if self.eval_order not in (None,) + engine.EVAL_ORDERS:
      raise UserError(f"--eval-order: expected one of {', '.join(engine.EVAL_ORDERS)}, got '{self.eval_order}'")
    unknown = sorted(set(self.method_args) - set(methods.REGISTRY))
    if unknown:
      raise UserError(f"method arguments for unknown methods {unknown}")
    for m in self.methods:  # e.g. "perturbed" needs a method with a second (SAM) forward
      orders = methods.get(m, **self.method_args.get(m, {})).eval_orders
      if self.eval_order is not None and self.eval_order not in orders:
        raise UserError(f"--eval-order {self.eval_order}: not available for {m} (it has {', '.join(orders)})")

  def _check_source(self) -> None:
    """``--source-data``: a valid spec, the built-in benchmark's own by default, and given where a method has no
    source-free form."""
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

  def _check_realtime(self) -> None:
    """``--realtime``: a rate; ``--realtime-cost``: positive integers for methods of the run, with ``--realtime``."""
    self.realtime = realtime.parse_rate(self.realtime)
    self.realtime_cost = realtime.parse_costs(self.realtime_cost)
    if self.realtime_cost and self.realtime is None:
      raise UserError("--realtime-cost: fixes the costs of --realtime's protocol; give --realtime too")
    extra = [m for m in self.realtime_cost if m not in self.methods]
    if extra:
      raise UserError(f"--realtime-cost: {extra[0]} is not among the methods run ({', '.join(self.methods)})")
    if not (isinstance(self.cost_batches, int) and not isinstance(self.cost_batches, bool) and
            self.cost_batches >= 1):
      raise UserError(f"--cost-batches: expected a positive integer, got {self.cost_batches}")

  def _check_ccc_values(self) -> None:
    """``--ccc-*``: a target percentage, positive counts, and a stream whose plan fits in memory
    (`ccc.MAX_LENGTH`, `ccc.MAX_SPEED`)."""
    from pcsr_jax.data.generators import ccc

    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not (num(self.ccc_target) and 0 <= self.ccc_target <= 100):
      raise UserError(f"--ccc-target: expected a percentage 0..100 (CCC: 0, 20, 40), got {self.ccc_target}")
    for flag, v, top in (("--ccc-speed", self.ccc_speed, ccc.MAX_SPEED), ("--ccc-length", self.ccc_length,
                                                                          ccc.MAX_LENGTH),
                         ("--ccc-calibration-images", self.ccc_calibration_images, None)):
      if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= (top or v)):
        raise UserError(f"{flag}: expected a positive integer{f' up to {top:,}' if top else ''}, got {v}")
    if self.setting == "ccc":
      ccc.check_steps(ccc_stream.default_length(self), self.ccc_speed)

  def _no_device_path(self) -> str:
    """Why this run's data cannot be corrupted on the device ("" if it can)."""
    from pcsr_jax.data.generators import corrupt_device

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


def merge_method_args(base: dict, extra: dict) -> dict:
  """Per-method hyperparameters: ``extra``'s keys win over ``base``'s, method by method."""
  merged = {m: dict(a) for m, a in base.items()}
  for m, a in extra.items():
    merged[m] = {**merged.get(m, {}), **a}
  return merged


def check_severity(severity, fractional: bool) -> float:
  """``--severity``: an integer 1..5 for released data; generated data also takes a fraction in [0.01, 5] (the
  tables interpolated, `corruptions.params`). An integral value comes back as an int (records and file names
  then read ``5``, not ``5.0``)."""
  ok = isinstance(severity, (int, float)) and not isinstance(severity, bool) and math.isfinite(severity)
  if ok and float(severity).is_integer():
    severity = int(severity)
  if fractional:
    corr.check_fractional_severity(severity)
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
