"""Throughput of one online adaptation step: the JAX engine vs the PyTorch reference, in one run.

    python benchmarks/step_throughput.py --arch vit_small_patch16_224 --batch-size 16 --method pcsr

Each framework runs in its own subprocess (so peak memory is its own), on the
same architecture, method, batch size and protocol, random-init weights and
random batches. After ``--warmup`` steps it times ``--steps`` steps, waiting
for each step's logits (JAX ``block_until_ready``, CUDA ``synchronize``).
Prints images/s for both, their ratio, the compile (first-step) time and the
peak memory: device peak on a GPU, the process's peak RSS on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pcsr_jax.errors import ArgumentParser, UserError, run_cli  # noqa: E402


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_jax(a) -> dict:
  import jax
  import numpy as np

  from pcsr_jax import engine, methods
  from pcsr_jax.models import get_config, create, init_params

  cfg = get_config(a.arch)
  model = create(cfg)
  params = init_params(model, jax.random.key(0))
  method = methods.get(a.method)
  x = np.random.default_rng(0).standard_normal((a.batch_size, cfg.img_size, cfg.img_size, 3)).astype(np.float32)
  stats = None
  if method.uses_source_data():  # statistics of random "source" batches: the step's cost does not depend on them
    from pcsr_jax.methods.base import split
    prep = method.prepare(model, params, jax.random.key(0), a.batch_size)
    frozen, trainable = split(prep.params, prep.is_trainable)
    labels = np.arange(a.batch_size, dtype=np.int32) % cfg.num_classes
    stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, labels)] * 2))
  ad = engine.Adapter(method, model, params, batch_size=a.batch_size, source_stats=stats)
  state = ad.init_state()
  t0 = time.perf_counter()
  state, logits, _ = ad.step(state, x)
  logits.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(a.warmup):
    state, logits, _ = ad.step(state, x)
  logits.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(a.steps):
    state, logits, _ = ad.step(state, x)
    logits.block_until_ready()
  dt = time.perf_counter() - t0
  dev = jax.devices()[0]
  stats = dev.memory_stats() if dev.platform == "gpu" else None
  peak = stats["peak_bytes_in_use"] / 2**20 if stats else peak_rss_mb()
  return dict(framework="jax", device=dev.device_kind, images_per_s=a.steps * a.batch_size / dt,
              compile_s=compile_s, peak_mb=peak, peak_kind="device" if stats else "rss",
              version=jax.__version__)


def run_torch(a) -> dict:
  import numpy as np
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity
  from pcsr_jax.models import get_config

  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  cfg = get_config(a.arch)
  model = timm_parity.timm_model(cfg).to(dev)
  x = torch.from_numpy(np.random.default_rng(0).standard_normal(
      (a.batch_size, 3, cfg.img_size, cfg.img_size)).astype(np.float32)).to(dev)
  from pcsr_jax import methods

  # A method with source statistics computes them from ``source_batches`` (here random batches, as on the JAX
  # side; with the same labels when it needs them).
  method = methods.get(a.method)
  labels = torch.from_numpy(np.arange(a.batch_size) % cfg.num_classes).to(dev)
  kw = {"source_batches": [(x, labels) if method.source_labels else x] * 2} if method.uses_source_data() else {}
  ref = make_reference(a.method, model, a.batch_size, **kw)
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  t0 = time.perf_counter()
  ref.step(x)
  sync()
  first_s = time.perf_counter() - t0
  for _ in range(a.warmup):
    ref.step(x)
  sync()
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  t0 = time.perf_counter()
  for _ in range(a.steps):
    ref.step(x)
    sync()
  dt = time.perf_counter() - t0
  peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
  return dict(framework="torch", device=torch.cuda.get_device_name() if cuda else "cpu",
              images_per_s=a.steps * a.batch_size / dt, compile_s=first_s, peak_mb=peak,
              peak_kind="device" if cuda else "rss", version=torch.__version__, threads=torch.get_num_threads())


def _method_names() -> list[str]:
  from pcsr_jax import methods

  return list(methods.REGISTRY)


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="step_throughput.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_small_patch16_224")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--method", default="pcsr", help="a registered method: " + ", ".join(_method_names()))
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--frameworks", default="jax,torch", help="comma-separated: jax, torch")
  p.add_argument("--json", help="also write the results to this JSON file")
  p.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)  # internal: one framework
  return p


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  from pcsr_jax.models import get_config

  get_config(a.arch)  # validate before spawning workers
  from pcsr_jax import methods

  cost = methods.get(a.method).cost  # validates the name too
  if a.batch_size < 1 or a.steps < 1:
    raise UserError("--batch-size and --steps must be positive")
  if a.worker:
    print(json.dumps(run_jax(a) if a.worker == "jax" else run_torch(a)))
    return 0
  results = {}
  for fw in [f.strip() for f in a.frameworks.split(",") if f.strip()]:
    if fw not in ("jax", "torch"):
      raise UserError(f"--frameworks: unknown framework '{fw}' (expected jax, torch)")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw] + list(argv if argv is not None else sys.argv[1:])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
      tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
      raise UserError(f"{fw} worker failed: {tail}")
    results[fw] = json.loads(r.stdout.strip().splitlines()[-1])
  print(f"{a.method} step ({cost} per batch), {a.arch}, batch {a.batch_size}, {a.steps} timed steps after "
        f"{a.warmup} warm-up")
  for fw, r in results.items():
    print(f"  {fw:5s} [{r['device']}, {r['version']}]: {r['images_per_s']:8.2f} img/s   first step "
          f"(compile) {r['compile_s']:6.2f} s   peak {r['peak_kind']} {r['peak_mb']:8.0f} MiB")
  if "jax" in results and "torch" in results:
    ratio = results["jax"]["images_per_s"] / results["torch"]["images_per_s"]
    results["ratio_jax_over_torch"] = ratio
    print(f"  ratio JAX / PyTorch: {ratio:.2f}x")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(args=vars(a), results=results), f, indent=1)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
