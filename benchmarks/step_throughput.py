"""Throughput of one online adaptation step: the JAX engine vs the PyTorch reference, in one run.

    python -m benchmarks.step_throughput --arch vit_small_patch16_224 --batch-size 16 --method pcsr

Each framework runs in its own subprocess (so peak memory is its own), on the
same architecture, method, batch size and protocol, the same random weights and
the same random batch (`shared_inputs`), kept on the device. After the first step
and ``--warmup`` more (extended while the process's memory still grows) it
times ``--steps`` steps, waiting for each step's logits (JAX ``block_until_ready``,
CUDA ``synchronize``). ``--dtype bfloat16`` runs JAX's backbone in bf16
(float32 params and optimizer state) and PyTorch's step under bf16 autocast.
Prints images/s for both, their ratio, the compile (first-step) time and the
peak memory: device peak on a GPU, the process's peak RSS on the CPU.
``--rounds R`` runs each framework's subprocess R times, alternating which goes
first, and keeps each framework's fastest round: on a shared CPU one run's
figures can move by 10-30% (a slow spell of the machine), and the spell then
lands on one round, not on one framework's only figure. It also prints each round's own ratio (the two
workers of a round run back to back) and their median, which a drift between rounds does not move.
``--interleave K`` instead keeps both workers alive (each compiled and warmed up while the other waits; both
processes' memory held at once) and times K slices of ``--steps`` steps, the frameworks taking turns
(`round_order`), seconds apart: it prints every slice's images/s, each framework's median slice, each slice
pair's own ratio and their median.
A method that cannot run without arguments gets them from `benchmarks.method_args`, the same on both sides
(DePT-G: freshly initialised prompts and DINO heads of the official size; DDA: a small freshly initialised
guided-diffusion UNet, 32 px, at the official step counts; only the shapes matter to speed).
``--cpu-devices N`` splits the CPU into N JAX devices sharing the batch (one per
core is XLA:CPU's fastest setting; PyTorch uses all cores' threads either way); on a CPU-only host the default
is one per core (`default_cpu_devices`), so the table's setting needs no flag.
On a CPU-only host the command restarts under mimalloc (or ``PCSR_JAX_MALLOC``'s choice: `pcsr_jax.malloc`, as
every command does), and both workers inherit it: the same allocator on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mb() -> float:
  """The process's resident memory now (Linux; elsewhere its peak)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except OSError:
    return peak_rss_mb()


FP32_MATMUL = ("tf32", "highest")


def torch_fp32_matmul(policy: str) -> None:
  """float32 matmul/conv precision of PyTorch on Ampere+ GPUs, as `time_jax` sets JAX's: "tf32"
  (TensorFloat-32, ``allow_tf32``) or "highest" (true float32). No effect on CPUs or on bf16 math."""
  import torch

  torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = policy == "tf32"


def _time(step, sync, steps: int, warmup: int, max_s: float | None = None,
          max_extra: int = 8) -> tuple[float, float, int]:
  """(first-step seconds, seconds per step over the timed steps, how many were timed), syncing every step:
  the first step, then warm-up steps until ``warmup`` of them in a row left the process's resident memory
  within 1% (at most ``max_extra`` more than ``warmup``), then ``steps`` timed ones. A heap that is still growing (a
  single malloc arena takes a few steps to find room for a step's blocks: `pcsr_jax.malloc`) is warm-up, not
  the step's speed. ``max_s``: the warm-up and the timing each stop once they have run that long (at least one
  timed step), so that one slow method cannot eat a report's budget."""
  first_s = _warm(step, sync, warmup, max_s, max_extra)
  dt, n = _timed(step, sync, steps, max_s)
  return first_s, dt, n


def _warm(step, sync, warmup: int, max_s: float | None = None, max_extra: int = 8) -> float:
  """`_time`'s first step and warm-up; returns the first step's seconds."""
  t0 = time.perf_counter()
  step()
  sync()
  first_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  steady, done = 0, 0
  while steady < warmup and done < warmup + max_extra:
    if max_s is not None and time.perf_counter() - t0 > max_s:
      break
    before = rss_mb()
    step()
    sync()
    done += 1
    steady = steady + 1 if rss_mb() <= 1.01 * before else 0
  return first_s


def _timed(step, sync, steps: int, max_s: float | None = None) -> tuple[float, int]:
  """`_time`'s timed steps: (seconds per step, how many were timed)."""
  t0 = time.perf_counter()
  n = 0
  while n < steps:
    step()
    sync()
    n += 1
    if max_s is not None and time.perf_counter() - t0 > max_s:
      break
  return (time.perf_counter() - t0) / n, n


# The line prefix of the interleaved workers' answers (`serve`), so that anything else a library prints to
# stdout cannot be taken for one.
PROTOCOL = "@@ "


def serve(step, sync, steps: int, warmup: int, inp=None, out=None) -> tuple[float, float, int]:
  """An interleaved worker (``--interleave``): warm up as `_time` does, answer ``ready``, then time ``steps``
  steps for every ``run`` line read from ``inp`` (each answered with its seconds), until ``stop`` or the end of
  ``inp``. Returns `_time`'s triple, the seconds per step being the median over the slices run."""
  inp = sys.stdin if inp is None else inp
  out = sys.stdout if out is None else out
  first_s = _warm(step, sync, warmup)
  print(PROTOCOL + json.dumps({"ready": True, "compile_s": first_s}), file=out, flush=True)
  per_step, total = [], 0
  for line in inp:
    cmd = line.strip()
    if cmd == "stop":
      break
    if cmd != "run":
      raise UserError(f"interleaved worker: expected 'run' or 'stop' on stdin, got '{cmd}'")
    dt, n = _timed(step, sync, steps)
    per_step.append(dt)
    total += n
    print(PROTOCOL + json.dumps({"seconds_per_step": dt, "steps": n}), file=out, flush=True)
  if not per_step:
    raise UserError("interleaved worker: stopped before any 'run'")
  return first_s, statistics.median(per_step), total


def shared_inputs(arch: str, batch_size: int, seed: int = 0, scale: float = 0.05):
  """``(state_dict, images)``: the weights and the batch both frameworks run, made with numpy alone.

  ``state_dict`` is timm's layout (numpy), randomized as `timm_parity.randomize_` does (LayerNorm scales
  ``1 + N(0, 0.1^2)``, everything else ``N(0, scale^2)``); ``images`` ``[B, H, W, 3]`` standard normal (the
  PyTorch side transposes them to NCHW). The same weights and pixels matter beyond fairness: what a method
  does per step depends on its inputs (ROID's and DeYO's kept rows, EATA's filter, CoTTA's augmentation
  trigger), so only identical inputs give both frameworks the same work.
  """
  import numpy as np

  from pcsr_jax.models import get_config
  from pcsr_jax.weights.timm_map import expected_shapes

  cfg = get_config(arch)
  rng = np.random.default_rng(seed)
  sd = {}
  for name, shape in expected_shapes(cfg).items():
    noise = rng.standard_normal(shape, dtype=np.float32)
    is_ln_scale = name.endswith(("norm1.weight", "norm2.weight")) or name == "norm.weight"
    sd[name] = 1.0 + 0.1 * noise if is_ln_scale else scale * noise
  x = rng.standard_normal((batch_size, cfg.img_size, cfg.img_size, 3), dtype=np.float32)
  return sd, x


def jax_inputs(arch: str, batch_size: int, checkpoint: str | None = None):
  """(model, params, images): the float32 model of ``arch`` with the `shared_inputs` weights (or a converted
  checkpoint's) and the `shared_inputs` images."""
  from pcsr_jax.models import create, get_config
  from pcsr_jax.weights.timm_map import timm_to_flax

  sd, x = shared_inputs(arch, batch_size)
  if checkpoint:
    from pcsr_jax import checkpoint as ckpt

    model, params, _ = ckpt.load(checkpoint)
  else:
    model = create(get_config(arch))
    params = timm_to_flax(sd, model.config, "shared_inputs")
  return model, params, x


def jax_step(method_name: str, model, params, x, *, dtype: str = "float32", attention: str = "matmul",
             row_chunk: int | None = None):
  """``(step, sync, adapter, placed, box)``: one engine step of ``method_name`` on the batch ``x`` kept on the
  device; ``step()`` advances ``box['state']`` and sets ``box['logits']``, ``sync()`` waits for them. A method
  that needs arguments to run at all gets `method_args.jax_args` (DePT-G: fresh prompts of the official size)."""
  import jax
  import numpy as np

  from benchmarks import method_args
  from pcsr_jax import engine, methods
  from pcsr_jax.models.vit import compute_dtype

  model = model.clone(dtype=compute_dtype(dtype), attention=attention)
  method = methods.get(method_name, **method_args.jax_args(method_name, model, params))
  b = x.shape[0]
  stats = None
  if method.uses_source_data():  # statistics of random "source" batches: the step's cost does not depend on them
    from pcsr_jax.methods.base import split
    prep = method.prepare(model, params, jax.random.key(0), b)
    frozen, trainable = split(prep.params, prep.is_trainable)
    labels = np.arange(b, dtype=np.int32) % model.config.num_classes
    stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, labels)] * 2))
  ad = engine.Adapter(method, model, params, batch_size=b, source_stats=stats, row_chunk=row_chunk)
  placed = ad.place(x)
  box = {"state": ad.init_state()}

  def step():
    box["state"], box["logits"], _ = ad.step_placed(box["state"], placed)

  return step, lambda: box["logits"].block_until_ready(), ad, placed, box


def time_jax(method_name: str, model, params, x, *, steps: int, warmup: int, dtype: str = "float32",
             attention: str = "matmul", fp32_matmul: str = "tf32", row_chunk: int | None = None,
             interleaved: bool = False) -> dict:
  """Images/s of the engine's step on one batch kept on the device (as the PyTorch side keeps its own).

  A float32 run computes its matmuls at ``fp32_matmul`` precision ("tf32": TensorFloat-32 on Ampere+ GPUs,
  "highest": true float32; CPUs ignore it); a bf16 run at the backbone's own bf16. ``interleaved``: time the
  slices the coordinator asks for on stdin (`serve`).
  """
  import contextlib
  import warnings

  import jax

  b = x.shape[0]
  precision = (jax.default_matmul_precision("tensorfloat32" if fp32_matmul == "tf32" else "highest")
               if dtype == "float32" else contextlib.nullcontext())
  with precision, warnings.catch_warnings(record=True) as caught:  # the fused attention's fallback warns
    warnings.simplefilter("always")
    step, sync, _, _, _ = jax_step(method_name, model, params, x, dtype=dtype, attention=attention,
                                   row_chunk=row_chunk)
    first_s, dt, _ = (serve if interleaved else _time)(step, sync, steps, warmup)
  fell_back = any("using 'matmul'" in str(w.message) for w in caught)
  dev = jax.devices()[0]
  mem = dev.memory_stats() if dev.platform == "gpu" else None
  n = jax.device_count()
  return dict(framework="jax", device=dev.device_kind if n == 1 else f"{n} x {dev.device_kind}", devices=n,
              images_per_s=b / dt, step_ms=1e3 * dt, compile_s=first_s,
              dtype=dtype, attention="matmul" if fell_back else attention,
              fp32_matmul=fp32_matmul if dtype == "float32" else None,
              peak_mb=mem["peak_bytes_in_use"] / 2**20 if mem else peak_rss_mb(), peak_kind="device" if mem else "rss",
              version=jax.__version__, row_chunk=row_chunk)


def torch_inputs(arch: str, batch_size: int, state_dict=None):
  """(model, images) on the GPU if there is one: timm's model of ``arch`` with ``state_dict`` (numpy arrays;
  default the `shared_inputs` weights) and the `shared_inputs` images as NCHW."""
  import numpy as np
  import torch

  from pcsr_jax import timm_parity
  from pcsr_jax.models import get_config

  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  sd, x = shared_inputs(arch, batch_size)
  model = timm_parity.timm_model(get_config(arch), sd if state_dict is None else state_dict).to(dev)
  return model, torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(dev)


def torch_step(method_name: str, model, x, *, arch: str, dtype: str = "float32"):
  """``(step, sync)``: one step of the PyTorch reference of ``method_name`` on ``x`` (eager; ``dtype='bfloat16'``:
  the whole step under autocast). ``model`` is adapted in place: pass a fresh copy per call. ``arch``: its
  architecture, for `method_args.torch_args` (DePT-G: the JAX side's fresh prompts and heads)."""
  import contextlib

  import torch

  from benchmarks import method_args
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import methods

  if dtype not in ("float32", "bfloat16"):
    raise UserError(f"--dtype: expected float32 or bfloat16, got '{dtype}'")
  # A method with source statistics computes them from ``source_batches`` (here random batches, as on the JAX
  # side; with the same labels when it needs them).
  method = methods.get(method_name)
  labels = torch.arange(x.shape[0], device=x.device) % model.head.out_features
  kw = {"source_batches": [(x, labels) if method.source_labels else x] * 2} if method.uses_source_data() else {}
  ref = make_reference(method_name, model, x.shape[0], **kw, **method_args.torch_args(method_name, arch))
  autocast = (torch.autocast("cuda" if x.is_cuda else "cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
              else contextlib.nullcontext())

  def step():
    with autocast:
      ref.step(x)

  return step, torch.cuda.synchronize if x.is_cuda else (lambda: None)


def time_torch(method_name: str, model, x, *, arch: str, steps: int, warmup: int, dtype: str = "float32",
               max_s: float | None = None, interleaved: bool = False) -> dict:
  """Images/s of the PyTorch reference's step (`torch_step`); ``max_s`` as in `_time`; ``interleaved`` as in
  `time_jax`."""
  import torch

  cuda = x.is_cuda
  step, sync = torch_step(method_name, model, x, arch=arch, dtype=dtype)
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  first_s, dt, n = serve(step, sync, steps, warmup) if interleaved else _time(step, sync, steps, warmup, max_s)
  peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
  b = x.shape[0]
  return dict(framework="torch", device=torch.cuda.get_device_name() if cuda else "cpu", images_per_s=b / dt,
              step_ms=1e3 * dt, timed_steps=n, compile_s=first_s, dtype=dtype, peak_mb=peak,
              peak_kind="device" if cuda else "rss",
              fp32_matmul=("tf32" if torch.backends.cuda.matmul.allow_tf32 else "highest") if cuda and
              dtype == "float32" else None, version=torch.__version__, threads=torch.get_num_threads())


def check_counts(a: argparse.Namespace, **least: int) -> None:
  """The benchmarks' count flags: ``least`` maps each attribute of ``a`` (``batch_size`` for ``--batch-size``) to
  its smallest value, 1 or 0; one left unset (None) passes. The first below its least is a `UserError` naming
  the flag: ``--steps: expected a positive integer, got 0``."""
  for name, low in least.items():
    value = getattr(a, name)
    if value is not None and value < low:
      kind = "a positive" if low else "a non-negative"
      raise UserError(f"--{name.replace('_', '-')}: expected {kind} integer, got {value}")


def default_cpu_devices(batch_size: int, env=None, cores: int | None = None) -> int | None:
  """``--cpu-devices``' default: on a CPU-only host (`malloc.cpu_only`), one JAX device per core this process
  may run on, lowered to the most that divide ``batch_size`` (2 cores, batch 16: 2; batch 1: 1), the setting
  of docs/performance.md's CPU table; None (JAX's own devices) where a GPU or TPU may be used."""
  from pcsr_jax import malloc

  if not malloc.cpu_only(os.environ if env is None else env):
    return None
  cores = len(os.sched_getaffinity(0)) if cores is None else cores
  return max(d for d in range(1, max(cores, 1) + 1) if batch_size % d == 0)


def run_jax(a) -> dict:
  from pcsr_jax import engine

  engine.use_cpu_devices(a.cpu_devices if a.cpu_devices is not None else default_cpu_devices(a.batch_size))
  model, params, x = jax_inputs(a.arch, a.batch_size)
  return time_jax(a.method, model, params, x, steps=a.steps, warmup=a.warmup, dtype=a.dtype, attention=a.attention,
                  fp32_matmul=a.fp32_matmul, row_chunk=a.row_chunk, interleaved=a.serve)


def run_torch(a) -> dict:
  torch_fp32_matmul(a.fp32_matmul)
  model, x = torch_inputs(a.arch, a.batch_size)
  return time_torch(a.method, model, x, arch=a.arch, steps=a.steps, warmup=a.warmup, dtype=a.dtype,
                    interleaved=a.serve)


def _method_names() -> list[str]:
  from pcsr_jax import methods

  return list(methods.REGISTRY)


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="step_throughput.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_small_patch16_224")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--method", default="pcsr", help="a registered method, a comma-separated list, or 'all' (then a "
                 "table of every method): " + ", ".join(_method_names()))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps after the first; more (up to 8) while the process's memory still grows")
  p.add_argument("--frameworks", default="jax,torch", help="comma-separated: jax, torch")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="compute dtype: JAX's backbone dtype; PyTorch's step under bf16 autocast")
  p.add_argument("--attention", default="matmul", help="JAX attention kernel: matmul, xla, cudnn (GPU, bf16)")
  p.add_argument("--fp32-matmul", default="tf32", choices=FP32_MATMUL,
                 help="float32 matmul precision on Ampere+ GPUs, both frameworks (tf32: XLA's default)")
  p.add_argument("--cpu-devices", type=int, help="JAX on a CPU: split it into N devices sharing the batch (as the "
                 "harness's --cpu-devices; default on a CPU-only host: one per core, the most that divide the batch)")
  p.add_argument("--row-chunk", type=int, help="JAX: run the model in passes of N rows of the batch (the harness's "
                 "--row-chunk; on a CPU at batch 64, 16 keeps the activations in the caches)")
  p.add_argument("--rounds", type=int, default=1, help="run each framework R times, alternating which goes "
                 "first, and keep each one's fastest round")
  p.add_argument("--interleave", type=int, metavar="K", help="keep both frameworks' workers alive and time K "
                 "slices of --steps steps each, the frameworks taking turns, and report the median "
                 "of the slices' own ratios (both workers' memory is held at once)")
  p.add_argument("--json", help="also write the results to this JSON file")
  p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)  # internal: one framework
  p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: an interleaved worker
  return p


# One step of these takes tens of forwards (FOA 28, CoTTA up to 35, MEMO 65 per image, DDA 50 UNet forwards and
# backwards): in a table of every method they run `HEAVY_STEPS` timed steps after no warm-up, whatever --steps and
# --warmup say.
HEAVY = ("foa", "cotta", "memo", "dda")
HEAVY_STEPS = 1


def round_order(frameworks: Sequence[str], rounds: int) -> list[str]:
  """The order the workers run in: the frameworks once per round, the first round as given, every other round
  reversed (jax, torch, torch, jax, ...), so that neither framework always runs right after the other."""
  return [fw for r in range(rounds) for fw in (frameworks if r % 2 == 0 else list(reversed(frameworks)))]


def fastest_rounds(runs: dict[str, list[dict]]) -> dict[str, dict]:
  """Each framework's fastest round (highest images/s), with every round's images/s under ``rounds_images_per_s``
  in the order they ran; its first-step (compile) time is the first round's, so that it does not depend on R."""
  out = {}
  for fw, rs in runs.items():
    best = max(rs, key=lambda r: r["images_per_s"])
    out[fw] = {**best, "compile_s": rs[0]["compile_s"], "rounds_images_per_s": [r["images_per_s"] for r in rs]}
  return out


def paired_ratios(runs: dict[str, list[dict]]) -> list[float]:
  """JAX / PyTorch images/s of each round: round k's two workers ran back to back (`round_order`), so their ratio
  sees the same state of a machine whose speed drifts between rounds, as the fastest rounds' ratio need not."""
  return [j["images_per_s"] / t["images_per_s"] for j, t in zip(runs["jax"], runs["torch"])]


def _fmt_ips(ips: float) -> str:
  return f"{ips:.{2 if ips >= 1 else 4}f}"


def parse_frameworks(text: str) -> list[str]:
  """``--frameworks``: comma-separated names, each ``jax`` or ``torch``."""
  fws = [f.strip() for f in text.split(",") if f.strip()]
  for fw in fws:
    if fw not in ("jax", "torch"):
      raise UserError(f"--frameworks: unknown framework '{fw}' (expected jax, torch)")
  return fws


def chosen_methods(text: str) -> tuple[str, ...]:
  """``--method``: one registered name, a comma-separated list, or ``all``; an unknown name is a one-line error
  naming it, before any worker starts."""
  from pcsr_jax import methods
  from pcsr_jax.experiments.common import parse_methods

  chosen = parse_methods(text)
  for m in chosen:
    methods.get(m)
  return chosen


def _malloc_note() -> str:
  """The allocator this command runs under (`pcsr_jax.malloc`), if not glibc's defaults: a preloaded library
  (mimalloc, with the ``MIMALLOC_*`` options set) or glibc's malloc tunables. It moves CPU figures."""
  from pcsr_jax import malloc

  preloaded = malloc.preloaded_allocators(os.environ)
  if any("mimalloc" in p for p in preloaded):
    preloaded += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MIMALLOC_"))
  tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
  return "".join(f", {x}" for x in (" ".join(preloaded), ":".join(tunables)) if x)


def _worker_cmd(a, argv: Sequence[str], fw: str, method: str) -> list[str]:
  return [sys.executable, "-m", "benchmarks.step_throughput"] + list(argv) + [
      "--worker", fw, "--method", method, "--steps", str(a.steps), "--warmup", str(a.warmup)]


def _failed(method: str, fw: str, stderr: str) -> UserError:
  tail = (stderr.strip().splitlines() or ["no output"])[-1]
  return UserError(f"{method}: {fw} worker failed: {tail}")


def rounds_of_workers(a, method: str, argv: Sequence[str]) -> dict[str, list[dict]]:
  """Each framework's figures from ``a.rounds`` fresh worker processes, run one at a time (`round_order`)."""
  runs: dict[str, list[dict]] = {fw: [] for fw in parse_frameworks(a.frameworks)}
  for fw in round_order(list(runs), a.rounds):
    r = subprocess.run(_worker_cmd(a, argv, fw, method), capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
      raise _failed(method, fw, r.stderr)
    runs[fw].append(json.loads(r.stdout.strip().splitlines()[-1]))
  return runs


# Seconds between two slices of `interleaved_workers`: the worker that just stopped lets its threads' spin-wait
# (OpenMP's, XLA's pool's) run out before the other one starts.
SETTLE_S = 0.2


def interleaved_workers(a, method: str, argv: Sequence[str]) -> tuple[dict[str, dict], dict[str, list[float]]]:
  """``(figures, slices)``: both frameworks' workers alive at once (each started and warmed up while the other
  waits), then ``a.interleave`` slices of ``a.steps`` steps each, the frameworks taking turns in `round_order`'s
  order, so that slice k of one framework runs seconds from slice k of the other; ``slices[fw]``: each slice's
  images/s in order. A machine's drift between minutes-apart rounds (`rounds_of_workers`) then lands on both
  frameworks of a slice pair alike."""
  import tempfile

  fws = parse_frameworks(a.frameworks)
  procs: dict[str, subprocess.Popen] = {}
  errs = {fw: tempfile.TemporaryFile(mode="w+") for fw in fws}

  def answer(fw: str) -> dict:
    for line in procs[fw].stdout:
      if line.startswith(PROTOCOL):
        return json.loads(line[len(PROTOCOL):])
    procs[fw].wait()
    errs[fw].seek(0)
    raise _failed(method, fw, errs[fw].read())

  try:
    for fw in fws:
      procs[fw] = subprocess.Popen(_worker_cmd(a, argv, fw, method) + ["--serve"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=errs[fw], text=True, cwd=ROOT)
      answer(fw)  # ready: compiled and warmed up
    slices: dict[str, list[float]] = {fw: [] for fw in fws}
    for fw in round_order(fws, a.interleave):
      time.sleep(SETTLE_S)
      procs[fw].stdin.write("run\n")
      procs[fw].stdin.flush()
      slices[fw].append(a.batch_size / answer(fw)["seconds_per_step"])
    figures = {}
    for fw in fws:
      out, _ = procs[fw].communicate("stop\n")
      if procs[fw].returncode != 0:
        errs[fw].seek(0)
        raise _failed(method, fw, errs[fw].read())
      figures[fw] = json.loads(out.strip().splitlines()[-1])
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in errs.values():
      f.close()
  return figures, slices


def measure(a, method: str, argv: Sequence[str]) -> dict:
  """Both frameworks' figures for one method, each framework in its own worker subprocess: ``a.rounds`` fresh
  workers each, the fastest round kept, or with ``a.interleave`` two live workers taking turns, each
  framework's median slice kept; prints them."""
  from pcsr_jax import methods

  cost = methods.get(method).cost
  if a.interleave:
    figures, slices = interleaved_workers(a, method, argv)
    results = {fw: {**figures[fw], "images_per_s": statistics.median(s), "slices_images_per_s": s}
               for fw, s in slices.items()}
    how = f", {a.interleave} interleaved slices of {a.steps} steps each, median slice"
    per_step = f"after {a.warmup} warm-up"
  else:
    runs = rounds_of_workers(a, method, argv)
    results = fastest_rounds(runs)
    how = f", fastest of {a.rounds} rounds" if a.rounds > 1 else ""
    per_step = f"{a.steps} timed steps after {a.warmup} warm-up"
  print(f"{method} step ({cost} per batch), {a.arch}, batch {a.batch_size}, {a.dtype}, {per_step}{how}"
        f"{_malloc_note()}")
  for fw, r in results.items():
    chunk = f", {r['row_chunk']} rows per pass" if r.get("row_chunk") else ""
    if a.interleave:
      every = " (slices: " + ", ".join(_fmt_ips(x) for x in r["slices_images_per_s"]) + ")"
    else:
      every = (" (rounds: " + ", ".join(_fmt_ips(x) for x in r["rounds_images_per_s"]) + ")") if a.rounds > 1 else ""
    print(f"  {fw:5s} [{r['device']}, {r['version']}{chunk}]: {_fmt_ips(r['images_per_s']):>8s} img/s   first step "
          f"(compile) {r['compile_s']:6.2f} s   peak {r['peak_kind']} {r['peak_mb']:8.0f} MiB{every}")
  if "jax" in results and "torch" in results:
    ratio = results["jax"]["images_per_s"] / results["torch"]["images_per_s"]
    results["ratio_jax_over_torch"] = ratio
    paired = ""
    if a.interleave or a.rounds > 1:
      pairs = (paired_ratios({fw: [{"images_per_s": x} for x in s] for fw, s in slices.items()}) if a.interleave
               else paired_ratios(runs))
      results["paired_ratios"] = pairs
      results["paired_ratio_median"] = statistics.median(pairs)
      paired = (f"   paired {'slices' if a.interleave else 'rounds'}: {', '.join(f'{x:.2f}' for x in pairs)}, "
                f"median {results['paired_ratio_median']:.2f}x")
    print(f"  ratio JAX / PyTorch: {ratio:.2f}x{paired}", flush=True)
  return results


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  a = parser().parse_args(argv)
  from pcsr_jax.models import get_config

  get_config(a.arch)  # validate before spawning workers
  check_counts(a, batch_size=1, steps=1, warmup=0, rounds=1, interleave=1)
  if a.interleave and a.rounds > 1:
    raise UserError("--interleave and --rounds: choose one (interleaved slices replace rounds of fresh workers)")
  if a.worker:
    print(json.dumps(run_jax(a) if a.worker == "jax" else run_torch(a)))
    return 0
  chosen = chosen_methods(a.method)
  table = {}
  for m in chosen:
    steps, warmup = (HEAVY_STEPS, 0) if len(chosen) > 1 and m in HEAVY else (a.steps, a.warmup)
    table[m] = measure(argparse.Namespace(**{**vars(a), "steps": steps, "warmup": warmup}), m, argv)
  if len(chosen) > 1:
    fws = [fw for fw in ("jax", "torch") if any(fw in r for r in table.values())]
    print(f"\n{a.arch}, batch {a.batch_size}, {a.dtype}, images/s (FOA, CoTTA, MEMO: {HEAVY_STEPS} timed step "
          f"after the first)\n")
    print("| method | " + " | ".join({"jax": "JAX", "torch": "PyTorch"}[f] for f in fws)
          + (" | JAX / PyTorch |" if len(fws) == 2 else " |"))
    print("|---" * (len(fws) + 1 + (len(fws) == 2)) + "|")
    for m, r in table.items():
      cells = [f"{r[f]['images_per_s']:.2f}" for f in fws]
      if len(fws) == 2:
        cells.append(f"{r['ratio_jax_over_torch']:.2f}")
      print(f"| {m} | " + " | ".join(cells) + " |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(args=vars(a), results=table if len(chosen) > 1 else table[chosen[0]]), f, indent=1)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
