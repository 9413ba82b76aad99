"""Shared CLI of the experiment scripts: flags -> `harness.RunConfig`, presets, the run."""

from __future__ import annotations

import json
import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo

from pcsr_jax.errors import ArgumentParser, UserError


def parser(prog: str, description: str, presets: dict) -> ArgumentParser:
  p = ArgumentParser(prog=prog, description=description)
  p.add_argument("--preset", choices=sorted(presets), help="a paper table's settings (flags given explicitly win)")
  p.add_argument("--data", help="dataset root (ImageNet-C: <root>/<corruption>/<severity>/<wnid>/*.JPEG), or 'tfds'")
  p.add_argument("--checkpoint", help="a converted checkpoint dir (convert_weights.py)")
  p.add_argument("--dataset", help="imagenet_c (default), imagenet_r, imagenet_a, visda, folder")
  p.add_argument("--methods", help="comma-separated registered methods (source,tent,sar,pcsr,...), or 'all'")
  p.add_argument("--corruptions", help="'all' (the 15), 'heldout' (the 4), 'bar' (ImageNet-C-bar's 10: its folders "
                 "<root>/<name>/<level>/, or --clean-data), or comma-separated names")
  p.add_argument("--severity", type=severity_arg, help="1..5; with --clean-data (or the built-in benchmark) also a "
                 "fraction in (0, 5], the severity tables interpolated linearly")
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
  p.add_argument("--attention", help="attention kernel: matmul (default), xla, or cudnn (GPU, with bfloat16)")
  p.add_argument("--cpu-devices", type=int, help="on a CPU: split it into N JAX devices sharing each batch (one per "
                 "core is fastest; default 1)")
  p.add_argument("--row-chunk", type=int, help="run every forward of the model in passes of N rows (a divisor of "
                 "the batch size): on a CPU, 16 at batch 64 keeps the activations in the caches (faster; float32 "
                 "rounding differs from one pass)")
  g = p.add_argument_group("multi-process runs (jax.distributed; one process per host, a shared --output)")
  g.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and --process-id)")
  g.add_argument("--num-processes", type=int)
  g.add_argument("--process-id", type=int, help="0 .. num-processes - 1")
  g.add_argument("--distributed", action="store_true",
                 help="let jax detect the cluster (TPU pod, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--heartbeat-timeout", type=int, default=100,
                 help="seconds after which a dead process stops the others (default 100)")
  g.add_argument("--init-timeout", type=int, default=300,
                 help="seconds the processes wait for each other (and for the coordinator) at the start (default 300)")
  return p


def start_devices(a) -> None:
  """Sets the CPU device count and joins a multi-process run if the flags ask; call before anything touches
  JAX."""
  from pcsr_jax import distributed, engine

  engine.use_cpu_devices(a.cpu_devices)
  distributed.initialize(a.coordinator, a.num_processes, a.process_id, auto=a.distributed,
                         heartbeat_timeout_s=a.heartbeat_timeout, init_timeout_s=a.init_timeout)


def config_from_args(a, presets: dict, defaults: Optional[dict] = None):
  from pcsr_jax import harness

  kw = dict(defaults or {})
  if a.preset:
    kw.update(presets[a.preset])
  flags = dict(data=a.data, checkpoint=a.checkpoint, dataset=a.dataset, severity=a.severity, setting=a.setting,
               batch_size=a.batch_size, output=a.output, limit=a.limit, eval_order=a.eval_order,
               checkpoint_every=a.checkpoint_every, workers=a.workers, imbalance_ratio=a.imbalance_ratio,
               label_shift_indices=a.label_shift_indices, tfds_data_dir=a.tfds_data_dir, image_list=a.image_list,
               clean_data=a.clean_data, corruption_seed=a.corruption_seed, corrupt_on=a.corrupt_on,
               ccc_target=a.ccc_target, ccc_speed=a.ccc_speed, ccc_length=a.ccc_length,
               ccc_calibration_images=a.ccc_calibration_images,
               source_data=a.source_data, source_images=a.source_images, dtype=a.dtype, attention=a.attention,
               loader=a.loader or "auto", row_chunk=a.row_chunk)
  kw.update({k: v for k, v in flags.items() if v is not None})
  if a.methods:
    kw["methods"] = parse_methods(a.methods)
  if a.corruptions:
    kw["corruptions"] = parse_corruptions(a.corruptions)
  if a.seeds:
    kw["seeds"] = parse_seeds(a.seeds)
  if a.method_args:
    kw["method_args"] = merge_method_args(kw.get("method_args", {}), parse_method_args(a.method_args))
  kw["shuffle"] = not a.no_shuffle
  kw["save_predictions"] = a.save_predictions
  kw["resume"] = a.resume
  kw["progress"] = not a.no_progress
  if not kw.get("data") and not kw.get("clean_data"):
    raise UserError("--data or --clean-data is required (or use a preset that sets it)")
  if not kw.get("checkpoint"):
    raise UserError("--checkpoint is required with --data or --clean-data (or use a preset that sets it)")
  kw.setdefault("data", None)
  kw.setdefault("output", os.path.join("runs", a.preset or "imagenet_c"))
  return harness.RunConfig(**kw)


def severity_arg(text: str):
  """``--severity``: an int, or a float for a fraction (the harness checks the range for the data)."""
  try:
    value = float(text)
  except ValueError:
    raise UserError(f"--severity: expected a number, got '{text}'") from None
  return int(value) if value.is_integer() else value


def merge_method_args(base: dict, extra: dict) -> dict:
  """Per-method hyperparameters: ``extra``'s keys win over ``base``'s, method by method."""
  merged = {m: dict(a) for m, a in base.items()}
  for m, a in extra.items():
    merged[m] = {**merged.get(m, {}), **a}
  return merged


def parse_list(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_methods(text: str) -> tuple[str, ...]:
  """``--methods``: comma-separated names, or ``all`` (every registered method)."""
  from pcsr_jax import methods

  return tuple(methods.REGISTRY) if text.strip() == "all" else parse_list(text)


def parse_corruptions(text: str) -> tuple[str, ...]:
  """'all' (the 15), 'heldout' (the 4), 'bar' (ImageNet-C-bar's 10), or comma-separated names."""
  from pcsr_jax.data import corruptions_bar, imagenet

  return {"all": imagenet.CORRUPTIONS, "heldout": imagenet.HELDOUT_CORRUPTIONS,
          "bar": corruptions_bar.NAMES}.get(text) or parse_list(text)


def parse_seeds(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(s) for s in text.split(","))
  except ValueError:
    raise UserError(f"--seeds: expected comma-separated integers, got '{text}'") from None


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


def run_table(a, presets: dict, preset: str, runs: dict, title: str, output: Optional[str] = None) -> str:
  """The tail of a table script: its preset under the flags, the runs, one summary table (`run_many`);
  without --output, the runs go to ``runs/<output or preset>``."""
  a.preset = a.preset or preset
  base = config_from_args(a, presets)
  if not a.output:
    base.output = os.path.join("runs", output or preset)
  return run_many(base, runs, title)


def run_many(base, runs: dict, title: str, column: str = "Avg.") -> str:
  """Runs ``{row_name: RunConfig overrides}`` into ``<output>/<row_name>`` and prints one summary table:
  the mean accuracy over corruptions (± std over seeds) of each row and method."""
  import dataclasses

  from pcsr_jax import harness
  from pcsr_jax.results import fmt_mean_std

  lines = [f"| {title} | method | {column} |", "|---|---|---|"]
  for name, over in runs.items():
    cfg = dataclasses.replace(base, output=os.path.join(base.output, name), **over)
    res = harness.run(cfg)
    for m in cfg.methods:
      lines.append(f"| {name} | {m} | {fmt_mean_std([100 * v for v in mean_accuracy(res['records'], m, cfg.seeds)])} |")
  table = "\n".join(lines) + "\n"
  os.makedirs(base.output, exist_ok=True)
  with open(os.path.join(base.output, "summary.md"), "w") as f:
    f.write(table)
  print(table)
  return table
