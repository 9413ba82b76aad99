"""Shared CLI of the experiment scripts: flags -> `harness.RunConfig`, presets, the run."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo

from pcsr_jax.errors import ArgumentParser, UserError

HEARTBEAT_TIMEOUT_S = 100  # --heartbeat-timeout's default
INIT_TIMEOUT_S = 300  # --init-timeout's default
# The seeds a run takes (`config.MAX_SEED`, written out here so that the flags are checked before jax loads; kept
# equal by tests/test_cli_start.py) and why.
MAX_SEED = 2**32 - 1
SEED_RANGE_WHY = "jax.random.key keeps a seed's low 32 bits: a larger one would repeat a smaller one's run"


def parser(prog: str, description: str, presets: dict) -> ArgumentParser:
  p = ArgumentParser(prog=prog, description=description)
  p.set_defaults(command=prog)  # for messages
  p.add_argument("--preset", choices=sorted(presets), help="a paper table's settings (flags given explicitly win)")
  p.add_argument("--data", help="dataset root (ImageNet-C: <root>/<corruption>/<severity>/<wnid>/*.JPEG), or 'tfds'")
  p.add_argument("--checkpoint", help="a converted checkpoint dir (convert_weights.py)")
  p.add_argument("--dataset", help="imagenet_c (default), imagenet_r, imagenet_a, visda, folder")
  p.add_argument("--methods", help="comma-separated registered methods (source,tent,sar,pcsr,...), or 'all'")
  p.add_argument("--corruptions", help="'all' (the 15), 'heldout' (the 4), 'bar' (ImageNet-C-bar's 10: its folders "
                 "<root>/<name>/<level>/, or --clean-data), or comma-separated names")
  p.add_argument("--severity", type=severity_arg, help="1..5; with --clean-data (or the built-in benchmark) also a "
                 "fraction in [0.01, 5], the severity tables interpolated linearly")
  p.add_argument("--clean-data", help="generate ImageNet-C in the stream from clean images instead of --data: a clean "
                 "ImageNet folder (<dir>/<wnid>/*.JPEG, e.g. val) or 'tfds[:<name>[:<split>]]' (default imagenet2012 "
                 "validation); the release's pipeline (docs/corruption_stream.md)")
  p.add_argument("--corrupt-on", choices=["auto", "host", "device"], help="--clean-data: corrupt on the host "
                 "(numpy, the release's code) or on the accelerator (jitted; docs/corruption_stream.md for the "
                 "distance); default auto: the device on a GPU/TPU when every corruption has a device version")
  p.add_argument("--corruption-seed", type=int, help="generated data: the seed of the random corruptions (default 0)")
  p.add_argument("--seeds", help="comma-separated, e.g. 2022,2023,2024")
  p.add_argument("--setting", help="normal, continual, mix_shifts, label_shifts, bs1, gradual (severity 1 -> 5 -> 1 "
                 "per corruption, never reset; --severity is not used), ccc (CCC's continuously changing "
                 "corruptions, from --clean-data or the built-in benchmark's images)")
  g = p.add_argument_group("--setting ccc (docs/corruption_stream.md)")
  g.add_argument("--ccc-target", type=float, help="the baseline accuracy in %% the walk holds: 0, 20 (default), 40 "
                 "(CCC-Hard, -Medium, -Easy)")
  g.add_argument("--ccc-speed", type=int, help="images per walk step (CCC: 1000 (default), 2000, 5000)")
  g.add_argument("--ccc-length", type=int, help="images in the stream (default: CCC's 7,500,000; built-in: 15 x "
                 "--images)")
  g.add_argument("--ccc-calibration-images", type=int, help="held-out clean images that calibrate the walk "
                 "(default 500)")
  p.add_argument("--batch-size", type=int)
  p.add_argument("--output", help="output dir (default: runs/<name>)")
  p.add_argument("--limit", type=int, help="at most N images per corruption (or stream segment)")
  p.add_argument("--no-shuffle", action="store_true", help="keep file order")
  p.add_argument("--eval-order", choices=["before", "after", "perturbed", "both"],
                 help="default: each method's own; 'perturbed': a SAM method's second forward (sar, pcsr); "
                      "'both' (built-in benchmark) runs each method twice, before and after")
  p.add_argument("--save-predictions", action="store_true")
  p.add_argument("--resume", action="store_true", help="continue an interrupted run in --output")
  p.add_argument("--checkpoint-every", type=int, help="save progress every N batches (default 50)")
  p.add_argument("--workers", type=int, help="decode threads or processes (default: all cores)")
  p.add_argument("--loader", choices=["auto", "threads", "processes"],
                 help="decode in threads or worker processes, which are not held back by the GIL (for hosts with "
                      "many cores feeding a GPU); default auto: processes on a GPU/TPU host with 8+ cores, else "
                      "threads; the results are the same")
  p.add_argument("--imbalance-ratio", type=float, help="label_shifts: ir (default 500000)")
  p.add_argument("--label-shift-indices", help="label_shifts: a SAR index file (.npy) instead of the generator")
  p.add_argument("--tfds-data-dir", help="--data tfds: where the prepared TFDS datasets live")
  p.add_argument("--image-list", help="visda: the list under --data (default: the official "
                                      "val_filelists/imagenet_c_r_o_filelist.txt)")
  p.add_argument("--source-data", help="clean source images for EATA/CFA/FOA's statistics: an ImageNet folder "
                 "(<dir>/<wnid>/*.JPEG), 'tfds[:<name>[:<split>]]' (default imagenet2012 validation) or "
                 "'fmnist-train'; cached next to the checkpoint (experiments/source_stats.py computes them ahead)")
  p.add_argument("--source-images", type=int, help="use at most N source images per method's statistics")
  p.add_argument("--method-args", help="JSON of per-method hyperparameters, e.g. '{\"pcsr\": {\"lr_dsn\": 0.05}}'")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--dtype", help="backbone compute dtype: float32 (default, the paper numbers) or bfloat16 "
                                 "(params, losses, optimizer state stay float32)")
  p.add_argument("--attention", help="attention kernel: auto (default: cudnn on a GPU in bfloat16, xla on a GPU "
                 "in float32 and on a TPU, matmul on a CPU), matmul, xla, or cudnn")
  p.add_argument("--cpu-devices", type=int, help="on a CPU: split it into N JAX devices sharing each batch (one per "
                 "core is fastest; default 1)")
  p.add_argument("--row-chunk", type=int, help="run every forward of the model in passes of N rows (a divisor of "
                 "the batch size): on a CPU, 16 at batch 64 keeps the activations in the caches (faster; float32 "
                 "rounding differs from one pass)")
  g = p.add_argument_group("the realistic online protocol and each method's cost (docs/paper_tables.md)")
  g.add_argument("--realtime", help="the stream reveals its batches at a constant speed: 'source' (one batch per "
                 "Source forward on this device, Alfarra et al. ICML 2024) or N images per second; a method of "
                 "relative cost C adapts on one batch in C and predicts the others with its latest parameters")
  g.add_argument("--realtime-cost", help="METHOD=C,...: fix these methods' relative costs instead of measuring "
                 "them (reproducible on other hardware)")
  g.add_argument("--cost-batches", type=int, help="timed steps per method after compilation, for the cost table "
                 "and --realtime's C (default 5)")
  g = p.add_argument_group("a table on many devices and workers (docs/harness.md)")
  g.add_argument("--devices-per-unit", type=int, help="devices per unit of work (a method and seed on a domain, "
                 "or on the whole stream): one unit per group of local devices at once (default: 1 on a GPU/TPU "
                 "host with more units than devices, else all devices, each batch split over them)")
  g.add_argument("--executor", choices=["threads", "ray"], help="threads (default): this host's device groups; "
                 "ray: one Ray actor per device group of a Ray cluster (pip install -e \".[ray]\"), which restarts "
                 "lost actors and nodes' units; the driver writes the table")
  g.add_argument("--ray-address", help="--executor ray: the cluster's head, HOST:PORT or auto (default: a local "
                 "Ray instance on 127.0.0.1)")
  g.add_argument("--ray-timeout", type=float, help="--executor ray: seconds to wait for the local Ray instance "
                 "to start (default 300) or the cluster at --ray-address to answer (default 60); then one line, "
                 "exit 2")
  g = p.add_argument_group("multi-process runs (jax.distributed; one process per host, a shared --output)")
  g.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and --process-id)")
  g.add_argument("--num-processes", type=int)
  g.add_argument("--process-id", type=int, help="0 .. num-processes - 1")
  g.add_argument("--distributed", action="store_true",
                 help="let jax detect the cluster (TPU pod, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--heartbeat-timeout", type=int,
                 help=f"seconds after which a dead process stops the others (default {HEARTBEAT_TIMEOUT_S})")
  g.add_argument("--init-timeout", type=int, help="seconds the processes wait for each other (and for the "
                 f"coordinator) at the start (default {INIT_TIMEOUT_S})")
  return p


def check_flags(a) -> None:
  """What the flags alone can tell, checked before jax, flax or the methods are imported (a few seconds on a
  loaded machine): the method names (none given is refused: with none the built-in benchmark would run its
  default methods; the nearest names for a misspelled one), the seeds (their range: `parse_seeds`) and the JSON of
  --method-args. `config_from_args` checks everything again, with the registry and the data."""
  from pcsr_jax import method_names

  if getattr(a, "methods", None) is not None and a.methods.strip() != "all":
    method_names.check(method_list(a.methods))
  if getattr(a, "seeds", None) is not None:
    parse_seeds(a.seeds)
  parse_method_args(getattr(a, "method_args", None))
  from pcsr_jax import realtime  # no jax: a bad --realtime or --realtime-cost is one line at once

  rate = realtime.parse_rate(getattr(a, "realtime", None))
  if realtime.parse_costs(getattr(a, "realtime_cost", None)) and rate is None:
    raise UserError("--realtime-cost: fixes the costs of --realtime's protocol; give --realtime too")


def start_devices(a) -> None:
  """Checks what the flags alone can tell (`check_flags`), then sets the CPU device count and joins a
  multi-process run if the flags ask; call before anything touches JAX."""
  check_flags(a)
  from pcsr_jax import distributed, engine

  multi = (a.coordinator, a.num_processes, a.process_id, a.heartbeat_timeout, a.init_timeout)
  if not a.distributed and a.coordinator is None and any(v is not None for v in multi):
    flag = ("--num-processes", "--process-id", "--heartbeat-timeout", "--init-timeout")[
        next(i for i, v in enumerate(multi[1:]) if v is not None)]
    raise UserError(f"{flag}: for a multi-process run (with --coordinator or --distributed)")
  engine.use_cpu_devices(a.cpu_devices)
  distributed.initialize(a.coordinator, a.num_processes, a.process_id, auto=a.distributed,
                         heartbeat_timeout_s=_or(a.heartbeat_timeout, HEARTBEAT_TIMEOUT_S),
                         init_timeout_s=_or(a.init_timeout, INIT_TIMEOUT_S))


def _or(value, default):
  """A flag's value, or ``default`` where it was not given: 0 is a value (checked later), not "unset"."""
  return default if value is None else value


# The flags that are not fields of a run's configuration: where the processes and devices come from
# (`start_devices`), the built-in benchmark's --full (it sets other fields: `builtin_config`), and the table
# scripts' flags that choose their rows (imagenet_rav.py's datasets, ablations.py's table).
NOT_CONFIG = ("preset", "cpu_devices", "coordinator", "num_processes", "process_id", "distributed",
              "heartbeat_timeout", "init_timeout", "full", "imagenet_r", "imagenet_a", "visda", "table")
# A flag's `harness.RunConfig` field where the names differ.
FIELD = {"images": "images_per_corruption", "fashion_mnist_dir": "fmnist_dir", "no_shuffle": "shuffle",
         "no_progress": "progress"}


def given_flags(a) -> dict:
  """``{dest: value}`` of the flags set on the command line (a switch: when set)."""
  return {k: v for k, v in vars(a).items() if v is not None and v is not False and k != "command"}


def config_fields(given: dict) -> dict:
  """The `harness.RunConfig` fields the given flags set: the one translation of every command's flags."""
  kw = {}
  for dest, v in given.items():
    if dest in NOT_CONFIG or (dest == "eval_order" and v == "both"):  # both: the built-in's two runs
      continue
    if dest == "methods":
      v = parse_methods(v)
    elif dest == "corruptions":
      v = parse_corruptions(v)
    elif dest == "seeds":
      v = parse_seeds(v)
    elif dest == "method_args":
      v = parse_method_args(v)
    elif dest == "realtime_cost":
      from pcsr_jax import realtime

      v = realtime.parse_costs(v)
    elif dest in ("no_shuffle", "no_progress"):
      v = False
    kw[FIELD.get(dest, dest)] = v
  from pcsr_jax import harness

  unknown = set(kw) - {f.name for f in dataclasses.fields(harness.RunConfig)}
  assert not unknown, f"flags without a RunConfig field: {sorted(unknown)} (add them to FIELD or NOT_CONFIG)"
  return kw


def is_builtin(a) -> bool:
  """No --data and no --clean-data: the built-in Fashion-MNIST-C benchmark."""
  return a.data is None and a.clean_data is None


def config_from_args(a, presets: dict, runs: Optional[dict] = None, owned: tuple[str, ...] = ()) -> list:
  """The run configurations a command's flags ask for: one `harness.RunConfig` per run, or one when ``runs``
  is None, each validated.

  The one path from the flags to a run for every command (`imagenet_c.py`, with or without --data,
  `imagenet_rav.py`, `wild.py`, `ablations.py`): the preset's settings, then the built-in benchmark's frozen
  configuration where there is no --data (`builtin_config`), then every flag given (`config_fields`), then
  ``runs``' overrides (``{name: RunConfig fields}``: the command's rows; their ``method_args`` merged over the
  flags'). ``owned`` names the flags the command sets itself per row (refused if given). A flag that applies
  to none of the runs is refused with one line naming it (`check_applies`), and every value is checked
  (`RunConfig.validate`) before any work.
  """
  from pcsr_jax import harness
  from pcsr_jax.config import merge_method_args

  given = given_flags(a)
  builtin = runs is None and is_builtin(a)
  for dest in owned:
    if dest in given:
      raise UserError(f"{flag_name(dest)}: set by {a.command} for each of its runs "
                      f"({', '.join(runs or ())}); drop it")
  if a.eval_order == "both" and not builtin:
    raise UserError("--eval-order both: only for the built-in benchmark (no --data or --clean-data)")
  fields = config_fields(given)
  if builtin:
    kw = builtin_config(a, fields)
  else:
    kw = dict(presets[a.preset]) if a.preset else {}
    kw.update(fields)
    if "method_args" in fields:
      kw["method_args"] = merge_method_args(presets.get(a.preset, {}).get("method_args", {}), fields["method_args"])
    kw.setdefault("output", os.path.join("runs", a.preset or "imagenet_c"))
    kw.setdefault("loader", "auto")
  configs = []
  for name, over in (runs or {None: {}}).items():
    row = dict(kw, **over)
    if "method_args" in over:
      row["method_args"] = merge_method_args(kw.get("method_args", {}), over["method_args"])
    if name is not None:
      row["output"] = os.path.join(kw["output"], name)
    if not row.get("data") and not row.get("clean_data"):
      raise UserError("--data or --clean-data is required (or use a preset that sets it)")
    if not row.get("checkpoint"):
      raise UserError("--checkpoint is required with --data or --clean-data (or use a preset that sets it)")
    row.setdefault("data", None)
    configs.append(harness.RunConfig(**row))
  for cfg in configs:
    cfg.validate()
  check_applies(given, configs, builtin)
  return configs


def builtin_config(a, fields: dict) -> dict:
  """The built-in benchmark's `harness.RunConfig` fields under the flags: its frozen configuration
  (`builtin.run_config`: the 15 corruptions at severity 5, batch 64, 1,280 images, seed 2022, the tuned method
  arguments), with every flag's field over it."""
  from pcsr_jax.experiments import builtin

  if a.full and a.images is not None:
    raise UserError("--full runs all 10,000 images: drop --images")
  chosen = fields.get("methods") or (builtin.all_methods() if a.full or a.preset == "table1" else builtin.METHODS)
  out = os.path.join("runs", "builtin_full" if a.full else "builtin")
  images = builtin.FULL_IMAGES if a.full else builtin.default_images(chosen)
  seeds = builtin.FULL_SEEDS if a.full else builtin.DEFAULT_SEEDS
  cfg = builtin.run_config(fields.get("output", out), images=fields.get("images_per_corruption", images),
                           seeds=fields.get("seeds", seeds), methods=chosen,
                           method_args=fields.get("method_args"), full=a.full,
                           checkpoint=fields.get("checkpoint", builtin.CHECKPOINT))
  kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  kw.update({k: v for k, v in fields.items() if k != "method_args"})
  kw.update(methods=cfg.methods, method_args=cfg.method_args, loader=fields.get("loader", "auto"))
  return kw


def flag_name(dest: str) -> str:
  return "--" + dest.replace("_", "-")


def check_applies(given: dict, configs: list, builtin: bool) -> None:
  """One line for the first flag given that none of ``configs`` uses (`inapplicable`), naming the flag to use
  where there is one."""
  for dest, value in given.items():
    whys = [inapplicable(dest, value, cfg, builtin) for cfg in configs]
    if all(whys):
      raise UserError(f"{flag_name(dest)}: {whys[0]}")


def inapplicable(dest: str, value, cfg, builtin: bool) -> Optional[str]:
  """Why the flag ``dest`` (given as ``value``) does not apply to the run ``cfg``, or None if it does."""
  from pcsr_jax import methods
  from pcsr_jax.data import datasets

  spec = datasets.get(cfg.dataset)
  generated = builtin or cfg.clean_data is not None
  if dest in ("full", "images", "fashion_mnist_dir", "cache_dir") and not builtin:
    return ("the built-in benchmark's (no --data or --clean-data)" +
            ("; --limit caps the images per corruption" if dest in ("full", "images") else ""))
  if dest in ("dataset", "tfds_data_dir", "image_list", "label_shift_indices") and builtin:
    return "needs --data (it does not apply to the built-in benchmark)"
  if dest == "tfds_data_dir" and not any(str(v or "").split(":")[0] == "tfds"
                                         for v in (cfg.data, cfg.clean_data, cfg.source_data)):
    return "where TFDS data lives: for --data tfds, --clean-data tfds or --source-data tfds"
  if dest == "image_list" and cfg.dataset != "visda":
    return "VisDA-2021's image list (--dataset visda)"
  if dest == "corrupt_on" and cfg.clean_data is None:
    return "the device path corrupts --clean-data's images; give --clean-data"
  if dest == "corruption_seed" and not generated:
    return ("seeds generated corruptions (--clean-data, the built-in benchmark); --data holds released images")
  if dest in ("imbalance_ratio", "label_shift_indices") and cfg.setting != "label_shifts":
    return "for --setting label_shifts"
  if dest == "imbalance_ratio" and cfg.label_shift_indices:
    return "--label-shift-indices gives the label-shift stream itself"
  if dest in ("ray_address", "ray_timeout") and cfg.executor != "ray":
    return "for --executor ray"
  if dest.startswith("ccc_") and cfg.setting != "ccc":
    return "for --setting ccc"
  if dest in ("severity", "corruptions") and not spec.has_severity:
    return f"--dataset {cfg.dataset} has no corruptions or severities"
  if dest == "severity" and cfg.setting in ("gradual", "ccc"):
    return f"--setting {cfg.setting} walks the severities itself"
  if dest == "corruptions" and cfg.setting == "ccc":
    return "--setting ccc walks its own corruptions (--ccc-target chooses them)"
  if dest == "no_shuffle" and cfg.setting in ("ccc", "label_shifts"):
    return f"--setting {cfg.setting} draws its own order"
  if dest == "batch_size" and cfg.setting == "bs1" and value != 1:
    return "--setting bs1 runs batch size 1"
  if dest in ("source_data", "source_images"):
    uses = [m for m in cfg.methods if methods.get(m, **cfg.method_args.get(m, {})).uses_source_data()]
    if not uses:
      return (f"none of the methods ({', '.join(cfg.methods)}) uses source statistics (eata, cfa and foa do)")
  if dest == "method_args":
    extra = sorted(set(parse_method_args(value)) - set(cfg.methods))
    if extra:
      verb = "is" if len(extra) == 1 else "are"
      return f"{', '.join(extra)} {verb} not among the methods run ({', '.join(cfg.methods)})"
  return None


def severity_arg(text: str):
  """``--severity``: an int, or a float for a fraction (the harness checks the range for the data)."""
  try:
    value = float(text)
  except ValueError:
    raise UserError(f"--severity: expected a number, got '{text}'") from None
  return int(value) if value.is_integer() else value


def parse_list(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


def method_list(text: str, flag: str = "--methods") -> tuple[str, ...]:
  """The names of a comma-separated ``--methods``; none (``""``, ``","``) is a one-line `UserError`: a flag given
  empty must not fall back to the command's default methods, which nobody asked for."""
  names = parse_list(text)
  if not names:
    raise UserError(f"{flag}: no method given (got {text!r}); give one or more, comma-separated")
  return names


def parse_methods(text: str) -> tuple[str, ...]:
  """``--methods``: comma-separated names or ``package.module:Class`` of a method defined outside this package
  (imported and registered: `methods.load`), or ``all`` (every registered method); none is refused
  (`method_list`)."""
  from pcsr_jax import methods

  return tuple(methods.REGISTRY) if text.strip() == "all" else tuple(methods.load(m) for m in method_list(text))


def parse_corruptions(text: str) -> tuple[str, ...]:
  """'all' (the 15), 'heldout' (the 4), 'bar' (ImageNet-C-bar's 10), or comma-separated names."""
  from pcsr_jax.data import imagenet
  from pcsr_jax.data.generators import corruptions_bar

  return {"all": imagenet.CORRUPTIONS, "heldout": imagenet.HELDOUT_CORRUPTIONS,
          "bar": corruptions_bar.NAMES}.get(text) or parse_list(text)


def parse_seeds(text: str) -> tuple[int, ...]:
  """``--seeds``: comma-separated integers from 0 to `MAX_SEED`, checked here, before jax is imported."""
  try:
    seeds = tuple(int(s) for s in text.split(","))
  except ValueError:
    raise UserError(f"--seeds: expected comma-separated integers, got '{text}'") from None
  bad = next((s for s in seeds if not 0 <= s <= MAX_SEED), None)
  if bad is not None:
    raise UserError(f"--seeds: expected integers from 0 to {MAX_SEED}, got {bad}"
                    + (f" ({SEED_RANGE_WHY})" if bad > 0 else ""))
  return seeds


def parse_method_args(text: Optional[str]) -> dict:
  if not text:
    return {}
  try:
    extra = json.loads(text)
  except json.JSONDecodeError as e:
    raise UserError(f"--method-args: not valid JSON ({e.msg})") from None
  if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
    raise UserError("--method-args: expected a JSON object of objects, e.g. '{\"tent\": {\"lr\": 0.01}}'")
  return extra


def mean_accuracy(records, method: str, seeds) -> list[float]:
  """Per seed: the mean accuracy over corruptions of ``method``."""
  import numpy as np

  return [float(np.mean([r["accuracy"] for r in records if r["method"] == method and r["seed"] == s]))
          for s in seeds if any(r["method"] == method and r["seed"] == s for r in records)]


def eval_order_table(results: dict, methods) -> str:
  """``{order: harness result}`` -> one table: the average accuracy of each method per eval order."""
  from pcsr_jax.results import fmt_mean_std

  orders = list(results)
  lines = ["| method | " + " | ".join(f"predict {o} update" for o in orders) + " |", "|---" * (len(orders) + 1) + "|"]
  for m in methods:
    cells = []
    for o in orders:
      recs = results[o]["records"]
      if not any(r["method"] == m for r in recs):
        cells.append("n/a")  # the method has no such eval order
        continue
      cells.append(fmt_mean_std([100 * v for v in mean_accuracy(recs, m, sorted({r["seed"] for r in recs}))]))
    lines.append(f"| {m} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def table_configs(a, presets: dict, preset: str, runs: dict, output: Optional[str] = None,
                  owned: tuple[str, ...] = ()) -> dict:
  """A table script's ``{row: RunConfig}``: its preset under the flags, one run per row of ``runs``, all built and
  checked before the first runs (`config_from_args`); without --output, in ``runs/<output or preset>``."""
  a.preset = a.preset or preset
  if not a.output:
    a.output = os.path.join("runs", output or preset)
  return dict(zip(runs, config_from_args(a, presets, runs, owned)))


def run_many(configs: dict, output: str, title: str, column: str = "Avg.") -> str:
  """Runs ``{row_name: RunConfig}`` and prints one summary table into ``<output>/summary.md``: the mean
  accuracy over corruptions (± std over seeds) of each row and method."""
  from pcsr_jax import harness, run_setup
  from pcsr_jax.results import fmt_mean_std

  for cfg in configs.values():
    run_setup.check_data(cfg)
  lines = [f"| {title} | method | {column} |", "|---|---|---|"]
  for name, cfg in configs.items():
    res = harness.run(cfg)
    for m in cfg.methods:
      lines.append(f"| {name} | {m} | {fmt_mean_std([100 * v for v in mean_accuracy(res['records'], m, cfg.seeds)])} |")
  table = "\n".join(lines) + "\n"
  from pcsr_jax.files import atomic_path

  os.makedirs(output, exist_ok=True)
  with atomic_path(os.path.join(output, "summary.md")) as tmp, open(tmp, "w") as f:  # a link there is replaced
    f.write(table)
  print(table)
  return table
