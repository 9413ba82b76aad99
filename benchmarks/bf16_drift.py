"""How far bfloat16 moves each method's logits and accuracies from float32: built-in benchmark, parity fixture.

    python -m benchmarks.bf16_drift --methods all --images 256
    python -m benchmarks.bf16_drift --arch vit_base_patch16_224 --methods all --batches 2 --batch-size 8

Two measurements per method, the same stream for both dtypes (``--dtype bfloat16``: backbone in bf16, params,
LayerNorm statistics, softmax, losses and optimizer state in float32; `pcsr_jax.models.vit`):

* **logits**: the engine runs the method online over the first ``--batches`` batches of the first corruption
  (the built-in checkpoint, the benchmark's real images and hyperparameters) in both dtypes, each from its own
  state; per batch, the largest logit difference relative to the largest float32 |logit|, and the top-1
  agreement. Batch 1 is the source model's bf16 error (plus one update for "after" methods); later batches add
  the drift of the adapted weights. Methods with source statistics compute them from the stream's own first
  batches here (their cost and dtype path are what matter, not the data).
* **accuracy**: the harness runs the built-in benchmark (``--images`` per corruption, all 15 corruptions,
  seed 2022) in both dtypes; the average accuracy of each and their difference, and the share of the
  predictions that agree.

``--arch``: the logits on the timm parity tests' fixture instead, at full size: a timm model of that
architecture with every parameter randomized (`pcsr_jax.timm_parity.randomize_`, as
``tests/test_parity_timm.py``), converted (`timm_to_flax`), on random normal images, each method with its
official hyperparameters (no labels, so no accuracy: the top-1 agreement stands for it). It also prints
the source model's distance to timm's own float32 logits in both dtypes, so bf16's error reads against the
conversion's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Sequence

import numpy as np


from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

DTYPES = ("float32", "bfloat16")


def stream_batches(n_batches: int, batch_size: int):
  """The first ``n_batches`` batches (normalized float32 NHWC) of the built-in stream's first corruption."""
  from pcsr_jax import checkpoint
  from pcsr_jax.data import datasets
  from pcsr_jax.experiments import builtin

  cfg = builtin.run_config(tempfile.mkdtemp(), images=n_batches * batch_size, methods=("source",),
                           progress=False)
  cfg.validate()
  spec = datasets.get("fmnist_c")
  domains = spec.open(cfg, lambda *_: None)
  name, src = domains[0]
  pre = spec.preprocess(checkpoint.load_meta(builtin.CHECKPOINT))
  x = np.stack([pre(src.load(i)) for i in range(n_batches * batch_size)])
  labels = np.asarray(src.labels[:n_batches * batch_size], np.int32)
  return name, [(x[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def builtin_model():
  """``(model, params, meta, method_args)``: the built-in checkpoint and its benchmark's hyperparameters."""
  from pcsr_jax import checkpoint
  from pcsr_jax.experiments import builtin

  model, params, meta = checkpoint.load(builtin.CHECKPOINT)
  return model, params, meta, builtin.METHOD_ARGS


def fixture(arch: str, n_batches: int, batch_size: int, seed: int = 0):
  """``(model, params, meta, batches, timm model)``: the parity fixture of ``arch`` and random normal batches."""
  from pcsr_jax import timm_parity
  from pcsr_jax.models import create, get_config
  from pcsr_jax.weights.timm_map import preprocessing_meta, timm_to_flax

  cfg = get_config(arch)
  tm, sd = timm_parity.random_model(cfg, seed=seed, scale=0.05)  # randomize_'s scale, as tests/test_parity_timm.py
  x = np.random.default_rng(seed).standard_normal((n_batches * batch_size, cfg.img_size, cfg.img_size,
                                                   cfg.in_chans)).astype(np.float32)
  labels = np.zeros(len(x), np.int32)  # unused: no accuracy on the fixture
  batches = [(x[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(x), batch_size)]
  return create(cfg), timm_to_flax(sd, cfg), preprocessing_meta(cfg), batches, tm


def logit_drift(method_name: str, batches, model, params, meta, method_args) -> list[tuple[float, float]]:
  """Per batch: (max |logits_bf16 - logits_fp32| / max |logits_fp32|, top-1 agreement), each dtype adapting
  from its own state."""
  import jax

  from pcsr_jax import engine, methods
  from pcsr_jax.run_setup import with_preprocessing as _with_preprocessing
  from pcsr_jax.methods.base import split
  from pcsr_jax.models.vit import compute_dtype

  args = method_args.get(method_name, {})
  logits = {}
  for dtype in DTYPES:
    m = model.clone(dtype=compute_dtype(dtype))
    method = _with_preprocessing(methods.get(method_name, **args), args, meta)
    b = batches[0][0].shape[0]
    stats = None
    if method.uses_source_data():
      prep = method.prepare(m, params, jax.random.key(0), b)
      frozen, trainable = split(prep.params, prep.is_trainable)
      stats = method.compute_source_stats(prep, frozen, trainable, iter(batches))
    ad = engine.Adapter(method, m, params, batch_size=b, seed=2022, source_stats=stats)
    state, out = ad.init_state(), []
    for x, _ in batches:
      state, lg, _ = ad.step(state, x)
      out.append(np.asarray(lg[:len(x)], np.float32))
    logits[dtype] = out
  rows = []
  for a, b in zip(logits["float32"], logits["bfloat16"]):
    rows.append((float(np.abs(b - a).max() / np.abs(a).max()), float((a.argmax(-1) == b.argmax(-1)).mean())))
  return rows


def timm_distance(model, params, tm, x) -> dict[str, float]:
  """Per dtype: the source model's max |logits - timm's float32 logits| / max |timm's|, on ``x``."""
  import jax

  from pcsr_jax import timm_parity
  from pcsr_jax.models.vit import compute_dtype

  ref = timm_parity.timm_logits(tm, x)
  out = {}
  for dtype in DTYPES:
    lg = np.asarray(jax.jit(model.clone(dtype=compute_dtype(dtype)).apply)({"params": params}, x), np.float32)
    out[dtype] = float(np.abs(lg - ref).max() / np.abs(ref).max())
  return out


def accuracy_drift(methods_: Sequence[str], images: int, workdir: str) -> dict:
  """Average accuracy per dtype from the harness, and the share of agreeing predictions, per method."""
  from pcsr_jax import harness
  from pcsr_jax.experiments import builtin

  out = {}
  for dtype in DTYPES:
    cfg = builtin.run_config(os.path.join(workdir, dtype), images=images, methods=tuple(methods_), dtype=dtype,
                             save_predictions=True, progress=False)
    res = harness.run(cfg, log=lambda *_: None)
    out[dtype] = res["records"]
  table = {}
  for m in methods_:
    acc = {d: float(np.mean([r["accuracy"] for r in out[d] if r["method"] == m])) for d in DTYPES}
    agree, total = 0, 0
    pred_dir = {d: os.path.join(workdir, d, "predictions") for d in DTYPES}
    for f in sorted(os.listdir(pred_dir["float32"])):
      if f.startswith(f"{m}_"):
        p32 = np.load(os.path.join(pred_dir["float32"], f))
        p16 = np.load(os.path.join(pred_dir["bfloat16"], f))
        if list(p32["file_names"]) != list(p16["file_names"]):
          raise UserError(f"{f}: the two runs saw different images")
        agree += int((p32["predictions"] == p16["predictions"]).sum())
        total += len(p32["predictions"])
    table[m] = dict(acc_fp32=acc["float32"], acc_bf16=acc["bfloat16"], agreement=agree / max(total, 1))
  return table


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="bf16_drift.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", default="source,tent,sar,pcsr,pcsr-frozen", help="comma-separated, or 'all'")
  p.add_argument("--batches", type=int, default=4, help="batches of the logit comparison")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--images", type=int, default=256, help="images per corruption of the accuracy comparison "
                 "(0: skip it)")
  p.add_argument("--arch", help="logits on the parity fixture of this architecture (e.g. vit_base_patch16_224; "
                 "needs torch and timm) instead of the built-in benchmark")
  p.add_argument("--json", help="also write the results to this JSON file")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  from pcsr_jax.experiments import builtin
  from pcsr_jax.experiments.common import parse_methods

  chosen = builtin.all_methods() if a.methods == "all" else parse_methods(a.methods)
  if a.batches < 1 or a.batch_size < 1 or a.images < 0:
    raise UserError("--batches and --batch-size must be positive, --images non-negative")
  res = {}
  if a.arch:
    from pcsr_jax.models import get_config

    get_config(a.arch)  # an unknown name: the one-line error before torch loads
    model, params, meta, batches, tm = fixture(a.arch, a.batches, a.batch_size)
    method_args, a.images = {}, 0
    dist = timm_distance(model, params, tm, batches[0][0])
    res["timm_distance"] = dist
    print(f"bf16 vs float32, parity fixture {a.arch} (every parameter randomized), official hyperparameters; "
          f"logits over {a.batches} batches of {a.batch_size} random images", flush=True)
    print("  source vs timm float32, max |dlogit| / max |logit|: " + ", ".join(f"{d} {v:.1e}" for d, v in dist.items()),
          flush=True)
  else:
    model, params, meta, method_args = builtin_model()
    corruption, batches = stream_batches(a.batches, a.batch_size)
    print(f"bf16 vs float32, built-in checkpoint; logits over {a.batches} batches of {a.batch_size} ({corruption})",
          flush=True)
  for m in chosen:
    rows = logit_drift(m, batches, model, params, meta, method_args)
    res[m] = dict(logits=rows)
    print(f"  {m:12s} max |dlogit| / max |logit| per batch: " + " ".join(f"{r[0]:.4f}" for r in rows)
          + "   top-1 agreement: " + " ".join(f"{100 * r[1]:.0f}%" for r in rows), flush=True)
  if a.images:
    with tempfile.TemporaryDirectory() as d:
      acc = accuracy_drift(chosen, a.images, d)
    print(f"accuracy, built-in benchmark ({a.images} images x 15 corruptions, seed 2022):")
    print(f"  {'method':12s} {'float32':>8s} {'bfloat16':>9s} {'diff':>6s} {'same prediction':>16s}")
    for m, r in acc.items():
      res[m].update(r)
      print(f"  {m:12s} {100 * r['acc_fp32']:8.2f} {100 * r['acc_bf16']:9.2f} "
            f"{100 * (r['acc_bf16'] - r['acc_fp32']):+6.2f} {100 * r['agreement']:15.1f}%")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(args=vars(a), results=res), f, indent=1)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
