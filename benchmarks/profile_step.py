"""Where one adaptation step's time goes, JAX vs PyTorch, by kind of work; and how far each is from the peak.

    python -m benchmarks.profile_step --method tent --arch vit_small_patch16_224 --batch-size 16

Each framework runs in its own subprocess on the same architecture, method, batch size and random batch
(`step_throughput.jax_step` / `torch_step`). After warm-up it profiles ``--steps`` steps: JAX with
``jax.profiler`` (XLA's per-op events, each op of the compiled step classified by what its fused computation
contains), PyTorch with ``torch.profiler`` (self time per ATen op). Both are split into the same kinds:

  dense       the qkv / proj / fc1 / fc2 / head matmuls, forward and backward (XLA fusions with a plain dot)
  attention   Q K^T, softmax and A V with their backward (what has a T x T shape; PyTorch's fused SDPA kernels)
  layernorm   LayerNorm forward and backward (rsqrt; ``native_layer_norm*``)
  gelu        the MLP's exact GELU and its backward (erf; ``gelu*``)
  conv        the patch embedding
  other       everything else: residual adds, layout copies, the loss, filters, the optimizer, host overhead

XLA runs independent ops of a step concurrently, so JAX's per-op times can add up to more than the wall time
(measured on unprofiled steps). It also prints the step's floating-point work as achieved GFLOP/s per framework
(the same math runs on both sides, weight gradients of frozen params excluded), against each framework's own
float32 GEMM rate on this machine (a 2048^3 matmul), the practical peak of the step's dominant operation; and
XLA's memory analysis of the compiled step (per device: its arguments, outputs and temporaries, the activations
kept for the backward among them). The work is counted two ways: XLA's cost analysis of the compiled program
(every op, but a loop's body once and both branches of a ``cond``), and the executed count, the FLOPs of every
dot and convolution of the step (``2 * output size * contracted size``, from the HLO's shapes) times the times
it ran in the trace: loops per iteration, only the branches taken, every device. A list of methods (or ``all``)
ends with a table of every method's executed GFLOP per step and GFLOP/s against the GEMM peak.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import step_throughput as st
from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

KINDS = ("dense", "attention", "layernorm", "gelu", "conv", "other")


def _computations(hlo: str) -> dict[str, str]:
  """Body text of every computation in an HLO module, by name."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{") and not line.startswith(" "):
      name, lines = m.group(1), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(lines)
      name = None
    elif name is not None:
      lines.append(line)
  return out


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split(",") if d)


def op_flops(line: str, shapes: dict[str, tuple[int, ...]]) -> float:
  """Multiply-add FLOPs (2 per multiply-add) of one HLO instruction if it is a ``dot`` or ``convolution``: the
  output's size times the size of what each output element sums over; 0 for any other instruction."""
  m = _DEF.match(line)
  if not m or not re.search(r"\s(?:dot|convolution)\(", line):
    return 0.0
  out = math.prod(_dims(m.group(2)))
  lhs, rhs = re.search(r"\s(?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", line).groups()
  if " dot(" in line:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    return 2.0 * out * math.prod(shapes[lhs][d] for d in _dims(contracting.group(1) if contracting else ""))
  # A convolution sums over its kernel's spatial window and input features: the kernel's size over its outputs.
  rhs_labels = re.search(r"dim_labels=\w+_(\w+)->", line).group(1)
  kernel = shapes[rhs]
  return 2.0 * out * math.prod(kernel) / kernel[rhs_labels.index("o")]


def own_ops(hlo: str) -> Iterator[tuple[str, str]]:
  """``(name, text)`` of every instruction that runs as its own op: its line and the computations it calls.

  That is every instruction of every computation (names are unique in a module; those inside fusions never
  run alone, so never appear in a trace), except control flow: a ``while`` (MEMO's loop over images, ROID's and
  DeYO's over kept-row chunks), ``conditional`` or ``call`` spans the ops of its bodies, which are ops of
  their own."""
  comps = _computations(hlo)

  def body(text: str, depth: int = 0) -> str:
    called = re.findall(r"(?:calls|to_apply)=\{?%?([\w.\-]+)", text)
    return text + "".join("\n" + body(comps.get(c, ""), depth + 1) for c in called if depth < 4)

  for line in (ln for text in comps.values() for ln in text.splitlines()):
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if m and not re.search(r"\s(?:while|conditional|call)\(", line):
      yield m.group(1), body(line)


def classify_hlo(hlo: str, tokens: int) -> dict[str, str]:
  """Kind of every op of `own_ops`, from what it (or the computation it calls) does."""
  tt = re.compile(rf"\b{tokens},{tokens}\]")
  kinds = {}
  for name, text in own_ops(hlo):
    if " convolution(" in text:
      kind = "conv"
    elif tt.search(text):
      kind = "attention"
    elif " dot(" in text:
      kind = "dense"
    elif " erf(" in text:
      kind = "gelu"
    elif " rsqrt(" in text:
      kind = "layernorm"
    else:
      kind = "other"
    kinds[name] = kind
  return kinds


def flops_hlo(hlo: str) -> dict[str, float]:
  """FLOPs of the dots and convolutions of every op of `own_ops` (a fusion counts those it calls), by name;
  ops with none are left out."""
  shapes = {m.group(1): _dims(m.group(2)) for m in map(_DEF.match, hlo.splitlines()) if m}
  work = {name: sum(op_flops(ln, shapes) for ln in text.splitlines()) for name, text in own_ops(hlo)}
  return {name: f for name, f in work.items() if f}


def torch_kind(op: str) -> str:
  """Kind of a PyTorch (ATen) op by name."""
  if "scaled_dot_product" in op or "softmax" in op or op in ("aten::bmm", "aten::baddbmm"):
    return "attention"
  if op in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul") or "mkldnn_linear" in op:
    return "dense"
  if "layer_norm" in op:
    return "layernorm"
  if "gelu" in op:
    return "gelu"
  if "convolution" in op or op in ("aten::conv2d", "aten::_convolution"):
    return "conv"
  return "other"


def gemm_gflops(framework: str, n: int = 2048, reps: int = 5) -> float:
  """float32 GFLOP/s of an n^3 matmul in ``framework`` on this machine (best of ``reps``)."""
  if framework == "jax":
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    run = lambda: f(a, a).block_until_ready()  # noqa: E731
  else:
    import torch

    a = torch.ones((n, n))
    run = lambda: a @ a  # noqa: E731
    run()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best / 1e9


def _wall(step, sync, steps: int) -> float:
  """Seconds per step over ``steps`` steps, unprofiled (the profilers add overhead of their own)."""
  t0 = time.perf_counter()
  for _ in range(steps):
    step()
    sync()
  return (time.perf_counter() - t0) / steps


def profile_jax(a) -> dict:
  import jax

  from pcsr_jax import engine

  engine.use_cpu_devices(a.cpu_devices if a.cpu_devices is not None else st.default_cpu_devices(a.batch_size))
  model, params, x = st.jax_inputs(a.arch, a.batch_size)
  step, sync, ad, placed, box = st.jax_step(a.method, model, params, x, row_chunk=a.row_chunk)
  step()
  sync()
  lowered = ad.lower(box["state"], placed)
  compiled = lowered.compile()
  hlo = compiled.as_text()
  # XLA's cost analysis counts a loop's body once, whatever its trip count (MEMO's images, ROID's kept-row
  # chunks): no FLOP figure rather than a wrong one. --row-chunk's passes are unrolled, so they are counted.
  # It analyses one device's program (SPMD: every device runs a copy on its share of the batch): times devices.
  flops = 0.0 if re.search(r"\swhile\(", hlo) else (
      float(compiled.cost_analysis().get("flops", 0.0)) * len(jax.devices()))
  prompts = getattr(ad.method, "num_prompts", 0) or getattr(getattr(ad.prep.model, "prompt", None), "prompts", 0)
  kinds = classify_hlo(hlo, model.config.num_patches + 1 + prompts)
  op_work = flops_hlo(hlo)
  m = compiled.memory_analysis()  # the compiled program of one device (SPMD: each device runs its own copy)
  memory = {k: getattr(m, f"{k}_size_in_bytes", 0) / 2**30 for k in ("argument", "output", "alias", "temp")}
  for _ in range(a.warmup):
    step()
  sync()
  wall = _wall(step, sync, a.steps)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(a.steps):
        step()
        sync()
    trace = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(trace[0]) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  per_kind: dict = collections.Counter()
  per_op: dict = collections.Counter()
  executed = 0.0
  for e in events:
    op = (e.get("args") or {}).get("hlo_op")
    if e.get("ph") == "X" and op in kinds:
      per_kind[kinds[op]] += e["dur"] / 1e3 / a.steps  # us -> ms per step
      per_op[op] += e["dur"] / 1e3 / a.steps
      executed += op_work.get(op, 0.0) / a.steps
  return dict(framework="jax", version=jax.__version__, step_ms=1e3 * wall, flops=flops,
              executed_flops=executed, kinds=dict(per_kind),
              devices=len(jax.devices()), memory_gib=memory,
              top=[(op, kinds[op], ms) for op, ms in per_op.most_common(a.top)],
              gemm_gflops=gemm_gflops("jax"))


def profile_torch(a) -> dict:
  import torch
  from torch.profiler import ProfilerActivity, profile

  model, x = st.torch_inputs(a.arch, a.batch_size)
  step, sync = st.torch_step(a.method, model, x, arch=a.arch)
  for _ in range(1 + a.warmup):
    step()
  sync()
  wall = _wall(step, sync, a.steps)
  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(a.steps):
      step()
      sync()
  per_kind: dict = collections.Counter()
  per_op: dict = collections.Counter()
  for ev in prof.key_averages():
    ms = ev.self_cpu_time_total / 1e3 / a.steps
    per_kind[torch_kind(ev.key)] += ms
    per_op[ev.key] += ms
  return dict(framework="torch", version=torch.__version__, step_ms=1e3 * wall, kinds=dict(per_kind),
              top=[(op, torch_kind(op), ms) for op, ms in per_op.most_common(a.top)],
              gemm_gflops=gemm_gflops("torch"), threads=torch.get_num_threads())


def parser() -> ArgumentParser:
  p = ArgumentParser(prog="profile_step.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_small_patch16_224")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--method", default="tent", help="a registered method, a comma-separated list, or 'all' (then "
                 "a table of every method's work and rate)")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--top", type=int, default=8, help="also list the N most expensive ops of each framework")
  p.add_argument("--frameworks", default="jax,torch")
  p.add_argument("--cpu-devices", type=int, help="JAX: split the CPU into N devices sharing the batch (as "
                 "step_throughput.py, whose default this is: one per core on a CPU-only host); their ops overlap, "
                 "so the per-kind times add up to more than the wall (1: one device's own profile)")
  p.add_argument("--row-chunk", type=int, help="JAX: run the model in passes of N rows (as step_throughput.py)")
  p.add_argument("--json", help="also write the results to this JSON file")
  p.add_argument("--worker", choices=["jax", "torch"], help="internal: profile one framework in this process")
  return p


def profile(a, argv: Sequence[str], method: str) -> dict:
  """Both frameworks' profiles of ``method``'s step, each in its own subprocess; prints them."""
  res = {}
  for fw in st.parse_frameworks(a.frameworks):
    cmd = [sys.executable, "-m", "benchmarks.profile_step"] + list(argv) + ["--worker", fw, "--method", method]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
      raise UserError(f"{method}: {fw} worker failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    res[fw] = json.loads(r.stdout.strip().splitlines()[-1])
  jx = res.get("jax", {})
  flops, executed, devices = jx.get("flops"), jx.get("executed_flops"), jx.get("devices", 1)
  print(f"{method} step, {a.arch}, batch {a.batch_size}, float32, {a.steps} profiled steps"
        + (f", JAX on {devices} CPU devices" if devices > 1 else "")
        + (f", JAX in passes of {a.row_chunk} rows" if a.row_chunk else "")
        + (f"; {executed / 1e9:.1f} GFLOP per step executed (dots and convolutions, from the trace), "
           + (f"{flops / 1e9:.1f} by XLA's cost analysis" if flops else
              "no cost analysis: the compiled step loops, and XLA counts a loop's body once")
           if "jax" in res else ""))
  print(f"  {'ms per step':16s}" + "".join(f"{fw:>12s}" for fw in res))
  for k in KINDS:
    print(f"  {k:16s}" + "".join(f"{r['kinds'].get(k, 0.0):12.1f}" for r in res.values()))
  print(f"  {'ops, total':16s}" + "".join(f"{sum(r['kinds'].values()):12.1f}" for r in res.values()))
  print(f"  {'wall, unprofiled':16s}" + "".join(f"{r['step_ms']:12.1f}" for r in res.values()))
  if executed:
    print(f"  {'GFLOP/s':16s}" + "".join(f"{executed / r['step_ms'] / 1e6:12.1f}" for r in res.values()))
  print(f"  {'GEMM GFLOP/s':16s}" + "".join(f"{r['gemm_gflops']:12.1f}" for r in res.values()))
  if "jax" in res and "torch" in res:
    print(f"  ratio JAX / PyTorch (wall, images/s): {res['torch']['step_ms'] / res['jax']['step_ms']:.2f}x")
  if "jax" in res:
    mem = jx["memory_gib"]
    print(f"  JAX memory per device (XLA's analysis of the compiled step), GiB: arguments {mem['argument']:.2f}, "
          f"outputs {mem['output']:.2f} ({mem['alias']:.2f} of them in the arguments' buffers), "
          f"temporaries {mem['temp']:.2f}")
  for fw, r in res.items():
    print(f"  {fw} top ops (ms per step): " + "; ".join(f"{op} [{k}] {ms:.1f}" for op, k, ms in r["top"]))
  return res


def summary(a, table: dict[str, dict]) -> None:
  """One row per method: the executed work and each framework's rate against its best GEMM reading of the run."""
  fws = [fw for fw in ("jax", "torch") if any(fw in r for r in table.values())]
  name = {"jax": "JAX", "torch": "PyTorch"}
  # Each worker times the GEMM after its steps, and one reading can come out low on a shared machine: the
  # framework's fastest reading of the run is its peak.
  peak = {fw: max(r[fw]["gemm_gflops"] for r in table.values()) for fw in fws}
  print(f"\n{a.arch}, batch {a.batch_size}, float32: executed GFLOP per step (JAX's trace) and GFLOP/s (% of the "
        "framework's 2048^3 GEMM, " + ", ".join(f"{name[fw]} {peak[fw]:.0f}" for fw in fws) + ")\n")
  print("| method | GFLOP per step | " + " | ".join(f"{name[fw]} ms per step | {name[fw]} GFLOP/s" for fw in fws)
        + " |")
  print("|---|---|" + "---|---|" * len(fws))
  for m, res in table.items():
    gf = res.get("jax", {}).get("executed_flops", 0.0) / 1e9
    cells = [f"{gf:.1f}" if gf else "-"]
    for fw in fws:
      r = res[fw]
      rate = gf / r["step_ms"] * 1e3
      cells += [f"{r['step_ms']:.0f}", f"{rate:.1f} ({100 * rate / peak[fw]:.0f}%)" if gf else "-"]
    print(f"| {m} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(argv if argv is not None else sys.argv[1:])
  a = parser().parse_args(argv)
  from pcsr_jax import methods
  from pcsr_jax.models import get_config

  get_config(a.arch)
  st.check_counts(a, batch_size=1, steps=1, warmup=0, row_chunk=1, top=0)
  if a.worker:
    methods.get(a.method)
    print(json.dumps(profile_jax(a) if a.worker == "jax" else profile_torch(a)))
    return 0
  st.parse_frameworks(a.frameworks)
  chosen = st.chosen_methods(a.method)
  table = {}
  for i, m in enumerate(chosen):
    if i:
      print()
    table[m] = profile(a, argv, m)
  if len(chosen) > 1:
    summary(a, table)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(args=vars(a), results=table[chosen[0]]) if len(chosen) == 1 else
                dict(args=vars(a), methods=table), f, indent=1)
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
