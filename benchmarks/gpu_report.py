"""One-shot GPU report: JAX vs PyTorch step throughput per method and precision, and the end-to-end harness.

    python -m benchmarks.gpu_report                # ViT-B/16, batch 64, on the GPU (benchmarks/gpu.sh runs it)
    python -m benchmarks.gpu_report --cpu-smoke    # the same pipeline with ViT-Ti, batch 4, 1 step, a few images

Phases, each in its own subprocess with a deadline (a hang or crash costs that phase, never the report):

1. *prepare*: a randomized timm ViT (every parameter, `timm_parity.randomize_`) saved as safetensors and
   converted by the `convert_weights` pipeline; both frameworks and the harness use these weights.
2. *torch*: the PyTorch reference (`benchmarks/torch_reference.py`) of every method, eager float32 and the
   whole step under bf16 autocast, on one batch kept on the GPU.
3. *jax*: the engine's step of every method in float32 and with a bfloat16 backbone (`models.vit` ``dtype``),
   each with the default ``--attention auto`` (on a GPU: XLA's attention in float32, cuDNN's fused attention
   in bf16, falling back to the matmul attention when cuDNN refuses), on one batch kept on the device. Steps
   are lowered and compiled a group of ``--compile-threads`` at a time in threads (XLA's compiler releases the
   GIL), the first two alone so that the GEMM autotuning cache is warm for the others; each group is timed
   step by step once its compiles are done. The slowest methods run last.
4. *e2e*: ``experiments/imagenet_c.py`` (the harness, every core decoding, ``--loader`` from ``--e2e-loader``:
   worker processes by default) on generated 224 px JPEGs in the ImageNet-C layout, bfloat16, Source (the
   fastest step, so the hardest to feed) and TENT; the steady-state img/s is the second corruption's (the step
   compiles during the first), set against the bare step's img/s and the decode-only img/s, which is also
   measured at 1, 2, 4, ... threads and processes (where each loader stops scaling).
5. *extras* (time permitting): JAX with the matmul attention (the default before ``auto``) in both dtypes, to
   show what the resolved kernels buy.

Parts (``--part``): the report in three commands of at most 450 s each (one GPU command is 10 minutes), the
methods that changed or never ran on a GPU first: A ``source, tent, sar, pcsr, pcsr-frozen, dept-g, dda`` and
the end-to-end phase; B ``t3a, eta, eata, deyo, cfa, spa, roid, cmf, foa``, COME on its three hosts, VCT, DCT,
DPAL and the newer ZeroSiam, REM, DPCore, NEO, PEA, IMSE and FOZO; C ``cotta, adacontrast, memo`` (MEMO at
batch 16: ``--batch-sizes memo=16``). ``report.json`` is rewritten after every result, so a part cut off still
leaves what it measured in ``--out``.

Timing: ``--warmup`` steps after the first (compile) step, then ``--steps`` steps, each waited for (JAX
``block_until_ready``, ``torch.cuda.synchronize``); the warm-up and the timing each stop after ``--max-job-s``
(at least one timed step: MEMO's PyTorch step augments 64 views of each of 64 images on the host). float32
matmuls use TF32 on both sides by default (``--fp32-matmul``: XLA's GPU default; PyTorch's ``allow_tf32``).
Results: a markdown table on stdout, and ``report.json``, ``report.md`` and the workers' logs in ``--out``
(default ``$OUT`` if set).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TAG = "@@"  # workers' protocol lines on stdout: @@START <job id>, @@RESULT <json>, @@INFO <json>


def emit(kind: str, payload: Any) -> None:
  print(f"{TAG}{kind} {json.dumps(payload)}", flush=True)


# ----------------------------------------------------------------------------------------------------- workers


def worker_prepare(a) -> None:
  """Randomized timm model -> safetensors -> converted checkpoint (what a user runs, `convert_weights`)."""
  import numpy as np
  from safetensors.torch import save_file

  from pcsr_jax import timm_parity, weights
  from pcsr_jax.models import get_config

  t0 = time.perf_counter()
  model = timm_parity.timm_model(get_config(a.arch))
  timm_parity.randomize_(model, seed=0)
  src = os.path.join(a.work, "model.safetensors")
  save_file(model.state_dict(), src)
  weights.convert_checkpoint(src, os.path.join(a.work, "ckpt"))
  n = sum(int(np.prod(p.shape)) for p in model.parameters())
  emit("RESULT", dict(job="prepare", seconds=time.perf_counter() - t0, params=n))


def worker_torch(a) -> None:
  import copy

  import torch
  from safetensors.torch import load_file

  from benchmarks import step_throughput as st

  st.torch_fp32_matmul(a.fp32_matmul)
  sd = {k: v.numpy() for k, v in load_file(os.path.join(a.work, "model.safetensors")).items()}
  base, x = st.torch_inputs(a.arch, a.batch_size, sd)
  emit("INFO", dict(torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name()
                    if x.is_cuda else "cpu", cudnn=torch.backends.cudnn.version()))
  for job in a.jobs.split(","):
    method, dtype = job.split(":")
    emit("START", job)
    try:
      r = st.time_torch(method, copy.deepcopy(base), x, arch=a.arch, steps=a.steps, warmup=a.warmup, dtype=dtype,
                        max_s=a.max_job_s)
      emit("RESULT", dict(job=job, **r))
    except Exception as e:  # noqa: BLE001 -- one method's failure is reported, the others go on
      emit("RESULT", dict(job=job, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
    if x.is_cuda:
      torch.cuda.empty_cache()


def worker_jax(a) -> None:
  """Builds, lowers and compiles the jobs' steps a group at a time (threads), then times them one by one."""
  import concurrent.futures as cf
  import contextlib

  import jax
  import numpy as np

  from benchmarks import method_args
  from benchmarks import step_throughput as st
  from pcsr_jax import engine, methods, platforms
  from pcsr_jax.models import vit
  from pcsr_jax.models.vit import compute_dtype

  model0, params, x = st.jax_inputs(a.arch, a.batch_size, os.path.join(a.work, "ckpt"))
  import jaxlib

  emit("INFO", dict(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                    devices=[str(d) for d in jax.devices()], device_kind=jax.devices()[0].device_kind))

  def precision(dtype: str):
    if dtype != "float32":
      return contextlib.nullcontext()
    return jax.default_matmul_precision("tensorfloat32" if a.fp32_matmul == "tf32" else "highest")

  def build(job: str, attention: str):
    method_name, dtype, _ = job.split(":")
    t0 = time.perf_counter()
    with precision(dtype):  # thread-local config: set in the thread that lowers
      # Resolved for this platform first (`vit.for_platform`): a method's arguments (DePT-G's prompts) apply it.
      model = vit.for_platform(model0.clone(dtype=compute_dtype(dtype), attention=attention),
                               platforms.of_devices(jax.devices()))
      method = methods.get(method_name, **method_args.jax_args(method_name, model, params))
      stats = None
      if method.uses_source_data():  # statistics of random "source" batches: the step's cost does not depend on them
        from pcsr_jax.methods.base import split
        prep = method.prepare(model, params, jax.random.key(0), a.batch_size)
        frozen, trainable = split(prep.params, prep.is_trainable)
        labels = np.arange(a.batch_size, dtype=np.int32) % model.config.num_classes
        stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, labels)] * 2))
      ad = engine.Adapter(method, model, params, batch_size=a.batch_size, source_stats=stats)
      placed = ad.place(x)
      lowered = ad._step.lower(ad.frozen, ad.consts, ad.init_state(), *placed)
      used = ad.prep.model.attention  # what auto resolved to on this platform
      if used == "cudnn" and "cudnn" not in lowered.as_text().lower():
        used = "matmul"  # the model fell back while tracing (no cuDNN, or a shape/dtype it refuses)
      compiled = lowered.compile()
    return dict(ad=ad, placed=placed, compiled=compiled, compile_s=time.perf_counter() - t0, attention=used)

  def build_guarded(job: str):
    attention = job.split(":")[2]
    try:
      return build(job, attention)
    except Exception as e:  # noqa: BLE001
      if attention not in ("cudnn", "auto"):
        raise
      out = build(job, "matmul")  # cuDNN failed at compile time: the matmul attention instead
      out["attention_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      return out

  # Steps are compiled a group at a time (the first two alone: they warm the autotuning cache), and each group is
  # timed once all of its compiles are done: on an H100 (jax 0.11.2) a step captured into a CUDA graph while
  # other threads compiled and autotuned failed ("capturing stream has unjoined work") and left the process's
  # CUDA context broken for every later step; timings would also share the GPU with autotuning. Groups, rather
  # than every compile first, bound what one slow compile holds up (an H200 took 84 s for CoTTA's step).
  jobs = a.jobs.split(",")
  k = max(1, a.compile_threads)
  pool = cf.ThreadPoolExecutor(k)
  for group in [jobs[:2]] + [jobs[i:i + k] for i in range(2, len(jobs), k)]:
    futures = {j: pool.submit(build_guarded, j) for j in group}
    for f in futures.values():
      f.exception()
    for job in group:
      emit("START", job)
      try:
        b = futures.pop(job).result()
        ad, compiled, placed = b["ad"], b["compiled"], b["placed"]
        box = {"state": ad.init_state()}

        def step():
          box["state"], box["logits"], _ = compiled(ad.frozen, ad.consts, box["state"], *placed)

        first_s, dt, n = st._time(step, lambda: box["logits"].block_until_ready(), a.steps, a.warmup, a.max_job_s)
        dtype = job.split(":")[1]
        r = dict(job=job, framework="jax", images_per_s=a.batch_size / dt, step_ms=1e3 * dt, timed_steps=n,
                 compile_s=b["compile_s"], first_step_s=first_s, dtype=dtype, attention=b["attention"],
                 fp32_matmul=a.fp32_matmul if dtype == "float32" else None)
        if "attention_error" in b:
          r["attention_error"] = b["attention_error"]
        emit("RESULT", r)
        b = ad = compiled = placed = box = None  # free the device buffers before the next job
      except Exception as e:  # noqa: BLE001
        emit("RESULT", dict(job=job, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
  pool.shutdown(wait=False, cancel_futures=True)


def worker_e2e(a) -> None:
  """The harness (`experiments/imagenet_c.py`'s code path) on generated JPEGs; emits its throughput."""
  from pcsr_jax import harness

  out = os.path.join(a.work, f"e2e_{a.dtype}")
  cfg = harness.RunConfig(data=os.path.join(a.work, "data"), checkpoint=os.path.join(a.work, "ckpt"), output=out,
                          methods=tuple(a.jobs.split(",")), corruptions=CORRUPTIONS, seeds=(2022,),
                          batch_size=a.batch_size, progress=False, dtype=a.dtype, attention=a.attention,
                          loader=a.e2e_loader)
  t0 = time.perf_counter()
  try:
    harness.run(cfg, log=lambda *m: print(*m, file=sys.stderr, flush=True))
  except ImportError as e:  # matplotlib missing: the plots come after results.json
    print(f"harness outputs after results.json skipped: {e}", file=sys.stderr)
  with open(os.path.join(out, "results.json")) as f:
    res = json.load(f)
  wall = time.perf_counter() - t0
  for m in cfg.methods:
    recs = [r for r in res["records"] if r["method"] == m]
    steady = recs[-1]  # the last corruption: the step was compiled during the first
    tp = res["throughput"][f"{m}/seed2022"]
    emit("RESULT", dict(job=m, steady_images_per_s=steady["num_samples"] / max(steady["seconds"], 1e-9),
                        steady_images=steady["num_samples"], with_compile_images_per_s=tp["images_per_s"],
                        images=tp["images"], decode_images_per_s=res["decode_images_per_s"], dtype=a.dtype,
                        attention=a.attention, workers=os.cpu_count(), loader=a.e2e_loader, harness_wall_s=wall))
  # Decode + preprocess alone at a range of worker counts, threads and processes: where each stops scaling.
  from pcsr_jax.data import loader, sources, transforms

  src = [sources.imagenet_c_source(cfg.data, CORRUPTIONS[0], 5)]
  pre = transforms.Preprocess(224, (0.5,) * 3, (0.5,) * 3, crop_only=True).to_uint8
  counts = sorted({w for w in (1, 2, 4, 8, 16, 32) if w <= (os.cpu_count() or 1)} | {os.cpu_count() or 1})
  n = min(len(src[0]), 2048)
  for job, processes in (("decode_scaling", False), ("decode_scaling_processes", True)):
    emit("RESULT", dict(job=job, **{str(w): loader.decode_throughput(src, pre, n=n, workers=w, processes=processes)
                                    for w in counts}))


CORRUPTIONS = ("gaussian_noise", "fog")


def _one_jpeg(args) -> None:
  """A 224 px JPEG with natural-image-like statistics (smooth structure + grain), quality 85 like ImageNet-C."""
  import numpy as np
  from PIL import Image

  path, seed = args
  rng = np.random.default_rng(seed)
  low = Image.fromarray(rng.integers(0, 256, (14, 14, 3), dtype=np.uint8)).resize((224, 224), Image.BICUBIC)
  img = np.asarray(low, np.float32) + rng.normal(0, 12, (224, 224, 3))
  Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=85)


def make_jpegs(root: str, per_corruption: int, classes: int = 10) -> float:
  """``root/<corruption>/5/<wnid>/*.JPEG`` (real wnids), written by all cores; returns the seconds taken."""
  import multiprocessing as mp

  from pcsr_jax.data import imagenet

  t0 = time.perf_counter()
  wnids = imagenet.wnids()[::1000 // classes][:classes]
  todo = []
  for c in CORRUPTIONS:
    for k in range(per_corruption):
      d = os.path.join(root, c, "5", wnids[k % classes])
      os.makedirs(d, exist_ok=True)
      todo.append((os.path.join(d, f"ILSVRC2012_val_{k:08d}.JPEG"), len(todo)))
  with mp.get_context("fork").Pool(os.cpu_count()) as pool:
    pool.map(_one_jpeg, todo, chunksize=16)
  return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------------ driver


class Report:
  def __init__(self, a):
    self.a = a
    self.t0 = time.monotonic()
    self.data: dict[str, Any] = dict(config={k: v for k, v in vars(a).items() if k != "worker"}, phases={},
                                     info={}, results={}, failures={}, so_far={})

  def save(self) -> None:
    """report.json in ``--out`` as it stands (every result so far under ``so_far``)."""
    if self.a.out:
      os.makedirs(self.a.out, exist_ok=True)
      with open(os.path.join(self.a.out, "report.json"), "w") as f:
        json.dump(self.data, f, indent=1, default=str)

  def left(self) -> float:
    return self.a.budget_s - (time.monotonic() - self.t0)

  def log(self, msg: str) -> None:
    print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

  def run_worker(self, phase: str, jobs: list[str], deadline_s: float, extra: Sequence[str] = ()) -> dict:
    """Runs ``--worker phase`` over ``jobs`` until all report or ``deadline_s`` passes; a crashed worker is
    restarted without the job it was on. Returns ``{job: result}``."""
    results: dict[str, dict] = {}
    end = time.monotonic() + max(0.0, deadline_s)
    todo = list(jobs)
    log_path = os.path.join(self.a.work, f"{phase}.log")
    while todo and time.monotonic() < end:
      cmd = [sys.executable, "-m", "benchmarks.gpu_report", "--worker", phase, "--jobs", ",".join(todo)] + \
          self.common + list(extra)
      with open(log_path, "a") as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in p.stdout] + [lines.put(None)], daemon=True).start()
        current = None
        while True:
          try:
            line = lines.get(timeout=max(0.1, end - time.monotonic()))
          except queue.Empty:
            line = "timeout"
          if line is None or line == "timeout":
            break
          if not line.startswith(TAG):
            continue
          kind, _, payload = line[len(TAG):].partition(" ")
          payload = json.loads(payload)
          if kind == "START":
            current = payload
          elif kind == "INFO":
            self.data["info"].update(payload)
          elif kind == "RESULT":
            results[payload["job"]] = payload
            self.data["so_far"].setdefault(phase, {})[payload["job"]] = payload
            self.save()  # a part cut off by its command's limit still leaves what it measured
            if payload["job"] in todo:
              todo.remove(payload["job"])
            self.log(f"{phase} {payload['job']}: " + (f"FAILED {payload['error']}" if "error" in payload else
                                                       _brief(payload)))
        if p.poll() is None:
          p.kill()
        p.wait()
      if line == "timeout":
        for j in todo:
          results[j] = dict(job=j, error=f"not done within the {phase} phase's {deadline_s:.0f} s")
        self.log(f"{phase}: deadline reached, {len(todo)} job(s) left out")
        break
      if todo:  # the worker died: drop the job it was on (or, if none started, everything left)
        tail = _tail(log_path)
        bad = [current] if current in todo else list(todo)
        for j in bad:
          results[j] = dict(job=j, error=f"{phase} worker exited with code {p.returncode}: {tail}")
          todo.remove(j)
        self.log(f"{phase}: worker exited ({p.returncode}) on {', '.join(bad)}: {tail}")
    return results

  @property
  def common(self) -> list[str]:
    a = self.a
    return ["--arch", a.arch, "--batch-size", str(a.batch_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--work", a.work, "--fp32-matmul", a.fp32_matmul, "--compile-threads", str(a.compile_threads),
            "--max-job-s", str(a.max_job_s), "--e2e-loader", a.e2e_loader]

  def phase(self, name: str, seconds: float) -> None:
    self.data["phases"][name] = round(seconds, 1)


def _brief(r: dict) -> str:
  if "images_per_s" in r:
    return (f"{r['images_per_s']:.1f} img/s ({r['step_ms']:.1f} ms/step, compile/first step "
            f"{r.get('compile_s', 0):.1f} s{', attention ' + r['attention'] if 'attention' in r else ''})")
  if "steady_images_per_s" in r:
    return f"{r['steady_images_per_s']:.1f} img/s steady, {r['with_compile_images_per_s']:.1f} with compile"
  return json.dumps(r)


def _tail(path: str) -> str:
  try:
    with open(path) as f:
      lines = [l.strip() for l in f.read().splitlines() if l.strip()]
    return (lines or ["no output"])[-1][:300]
  except OSError:
    return "no log"


def has_torch_reference(method: str) -> bool:
  from benchmarks.torch_reference import ORIGINAL

  return method in ORIGINAL or os.path.isfile(
      os.path.join(ROOT, "benchmarks", "torch_methods", method.replace("-", "_") + ".py"))


def fmt(r: Optional[dict], key: str = "images_per_s") -> str:
  if r is None:
    return "-"
  if "error" in r:
    return "failed"
  return f"{r[key]:.0f}" if r[key] >= 100 else f"{r[key]:.1f}"


def ratio(j: Optional[dict], t: Optional[dict]) -> str:
  if not j or not t or "error" in j or "error" in t:
    return "-"
  return f"{j['images_per_s'] / t['images_per_s']:.2f}x"


def tables(rep: Report, names: list[str], bf16_attention: str) -> str:
  a, res = rep.a, rep.data["results"]
  info = rep.data["info"]
  jx, tc = res.get("jax", {}), res.get("torch", {})
  lines = [f"## Step throughput, img/s ({a.arch}, batch {a.batch_size}, {a.steps} timed steps after {a.warmup} "
           f"warm-up; {info.get('device_kind', info.get('device', '?'))})", "",
           f"float32 matmuls: {a.fp32_matmul} on both sides; JAX fp32 attention 'auto'; JAX bf16: bfloat16 "
           f"backbone (float32 params, optimizer state, losses), attention '{bf16_attention}' (the kernel each "
           f"ran: the notes); torch autocast: the whole step under bf16 autocast.", "",
           "| method | JAX fp32 | torch fp32 | ratio | JAX bf16 | torch autocast | ratio |",
           "|---|---|---|---|---|---|---|"]
  notes = []
  for m in names:
    j32, jbf = jx.get(f"{m}:float32:auto"), jx.get(f"{m}:bfloat16:{bf16_attention}")
    t32, tbf = tc.get(f"{m}:float32"), tc.get(f"{m}:bfloat16")
    lines.append(f"| {m} | {fmt(j32)} | {fmt(t32)} | {ratio(j32, t32)} | {fmt(jbf)} | {fmt(tbf)} | "
                 f"{ratio(jbf, tbf)} |")
    for r in (j32, jbf, t32, tbf):
      if r and "error" in r:
        notes.append(f"- {r['job']}: {r['error']}")
      elif r and r.get("attention_error"):
        notes.append(f"- {r['job']}: cuDNN attention failed ({r['attention_error']}); measured with 'matmul'")
      elif r and r.get("attention") == "matmul" and r["job"].split(":")[-1] in ("cudnn", "auto") and \
          r["job"].split(":")[1] == "bfloat16" and rep.data["info"].get("backend") == "gpu":
        notes.append(f"- {r['job']}: ran with attention 'matmul' (cuDNN unavailable at trace time)")
      if r and r.get("timed_steps", a.steps) < a.steps:
        notes.append(f"- {r['job']}: {r['timed_steps']} timed step(s) (--max-job-s {a.max_job_s:g})")
  sizes = rep.data.get("batch_sizes", {})
  notes += [f"- {m}: batch {b}" for m, b in sizes.items() if b != a.batch_size]
  for m in names:
    kernels = {r["job"].split(":")[1]: r.get("attention") for r in (jx.get(f"{m}:float32:auto"),
                                                                    jx.get(f"{m}:bfloat16:{bf16_attention}"))
               if r and "error" not in r}
    if kernels:
      notes.append(f"- {m}: attention " + ", ".join(f"{d} {k}" for d, k in kernels.items()))
  lines += [""] + notes
  extras = {k: v for k, v in jx.items() if k.endswith(":matmul") and bf16_attention != "matmul"}
  if extras:
    lines += ["", "JAX, matmul attention vs auto (img/s):", "", "| method | dtype | matmul | auto |",
              "|---|---|---|---|"]
    for k, r in extras.items():
      m, d, _ = k.split(":")
      lines.append(f"| {m} | {d} | {fmt(r)} | {fmt(jx.get(f'{m}:{d}:auto'))} |")
  e2e = res.get("e2e", {})
  if e2e:
    lines += ["", f"## End to end (harness, {len(CORRUPTIONS)} corruptions x {a.e2e_images} generated 224 px JPEGs, "
              f"bfloat16, {os.cpu_count()} decode workers, --loader {a.e2e_loader})", "",
              "| method | harness img/s (steady) | harness img/s (compile included) | bare step img/s | "
              "decode-only img/s | input-bound? |", "|---|---|---|---|---|---|"]
    for m, r in e2e.items():
      if m.startswith("decode_scaling"):
        continue
      if "error" in r:
        lines.append(f"| {m} | failed | | | | |")
        notes.append(f"- e2e {m}: {r['error']}")
        continue
      step = jx.get(f"{m}:bfloat16:{r['attention']}") or {}
      bare = step.get("images_per_s")
      bound = "-" if not bare else ("yes" if r["steady_images_per_s"] < 0.9 * bare else "no")
      lines.append(f"| {m} | {r['steady_images_per_s']:.0f} | {r['with_compile_images_per_s']:.0f} | "
                   f"{f'{bare:.0f}' if bare else '-'} | {r['decode_images_per_s']:.0f} | {bound} |")
    lines += ["", "(steady: the last corruption's images over its step-loop time; input-bound: the harness reaches "
              "less than 90% of the bare step's img/s)"]
    for job, what in (("decode_scaling", "threads"), ("decode_scaling_processes", "processes")):
      scaling = {k: v for k, v in e2e.get(job, {}).items() if k != "job" and k != "error"}
      if scaling:
        lines += ["", f"Decode + preprocess alone (the harness's loader, uint8 out), img/s by {what}: " +
                  ", ".join(f"{w}: {v:.0f}" for w, v in scaling.items())]
  phases = ", ".join(f"{k} {v:.0f} s" for k, v in rep.data["phases"].items())
  lines += ["", f"Phases: {phases}; total {time.monotonic() - rep.t0:.0f} s."]
  return "\n".join(lines) + "\n"


# The slowest steps (on an H200: FOA's 64 forwards per CMA-ES generation, CoTTA's 32 augmented views, and MEMO
# and AdaContrast's host-side augmentations and per-image copies) run last, so that a deadline costs the fewest
# rows; the tables keep the registry's order.
SLOW_LAST = ("foa", "cotta", "adacontrast", "memo")


def run_order(names: Sequence[str]) -> list[str]:
  return sorted(names, key=lambda m: SLOW_LAST.index(m) + 1 if m in SLOW_LAST else 0)


PART_S = 450.0  # each part's budget: one GPU command (600 s) with margin for the machine's start and the copy
PARTS = {
    "A": dict(methods="source,tent,sar,pcsr,pcsr-frozen,dept-g,dda", e2e=True),
    "B": dict(methods="t3a,eta,eata,deyo,cfa,spa,roid,cmf,foa,tent-come,sar-come,eata-come,vct,dct,dpal,zerosiam,"
                      "rem,dpcore,neo,pea,imse,fozo", e2e=False),
    "C": dict(methods="cotta,adacontrast,memo", e2e=False, batch_sizes="memo=16"),
}


def apply_part(a) -> None:
  """``--part``: its methods, batch sizes and end-to-end phase, and a budget of at most `PART_S`."""
  if a.part is None:
    return
  part = PARTS[a.part]
  a.methods = part["methods"] if a.methods is None else a.methods
  a.batch_sizes = a.batch_sizes or part.get("batch_sizes")
  if not part["e2e"]:
    a.e2e_methods, a.e2e_s = "none", 0.0
  if not a.cpu_smoke:
    a.budget_s = min(a.budget_s, PART_S)
    a.reserve_s = min(a.reserve_s, 0.55 * a.budget_s)


def batch_sizes(a, names: Sequence[str]) -> dict[str, int]:
  """Each method's batch: ``--batch-size``, or its ``--batch-sizes`` entry (``memo=16,cotta=32``)."""
  out = {m: a.batch_size for m in names}
  for item in filter(None, (a.batch_sizes or "").split(",")):
    m, _, b = item.partition("=")
    if not b.isdigit() or int(b) < 1:
      raise SystemExit(f"--batch-sizes: expected method=positive integer, got '{item}'")
    if m in out:
      out[m] = int(b)
  return out


def run_batched(rep: "Report", phase: str, jobs: list[str], sizes: dict[str, int], deadline_s: float,
                extra: Sequence[str] = ()) -> dict:
  """`Report.run_worker` once per batch size among the jobs' methods (in the jobs' order)."""
  out: dict[str, dict] = {}
  end = time.monotonic() + deadline_s
  for b in dict.fromkeys(sizes[j.split(":")[0]] for j in jobs):
    mine = [j for j in jobs if sizes[j.split(":")[0]] == b]
    out.update(rep.run_worker(phase, mine, end - time.monotonic(), ["--batch-size", str(b), *extra]))
  return out


def driver(a) -> int:
  from pcsr_jax import methods

  if a.cpu_smoke:  # ViT-Ti's width and depth at patch 32 (50 tokens): every phase and method, quickly
    a.arch, a.batch_size, a.steps, a.warmup, a.e2e_images = "vit_tiny_patch32_224", 4, 1, 0, 16
    a.compile_threads, a.budget_s, a.torch_s, a.reserve_s = 2, max(a.budget_s, 900), 400, 0
  apply_part(a)
  names = [m.strip() for m in a.methods.split(",") if m.strip()] if a.methods is not None else list(methods.REGISTRY)
  if not names:  # given empty: not every method
    raise SystemExit(f"--methods: no method given (got {a.methods!r}); give one or more, comma-separated")
  unknown = [m for m in names if m not in methods.REGISTRY]
  if unknown:  # before the work folder is made
    raise SystemExit(f"--methods: unknown method '{unknown[0]}'")
  rep = Report(a)
  own_work = a.work is None
  a.work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="pcsr_gpu_report_"))  # the workers run from ROOT
  os.makedirs(a.work, exist_ok=True)
  for m in list(names):
    if not has_torch_reference(m):
      rep.log(f"skipping {m}: no PyTorch reference (benchmarks/torch_methods/{m.replace('-', '_')}.py)")
      rep.data["failures"][m] = "no PyTorch reference"
      names.remove(m)
  sizes = batch_sizes(a, names)
  rep.data["batch_sizes"] = sizes
  rep.log(f"methods: {', '.join(names)}; {a.arch}, batch {a.batch_size}"
          f"{''.join(f', {m} {b}' for m, b in sizes.items() if b != a.batch_size)}; budget {a.budget_s:.0f} s; "
          f"work {a.work}{'; part ' + a.part if a.part else ''}")

  t = time.monotonic()
  prep = rep.run_worker("prepare", ["prepare"], min(240, rep.left()))
  rep.phase("prepare", time.monotonic() - t)
  if "error" in prep.get("prepare", {"error": ""}):
    rep.log("prepare failed: nothing to measure")
    rep.data["results"]["prepare"] = prep
    return finish(rep, names, "matmul")

  # e2e data is generated now (CPU only) so the e2e phase's budget is all harness.
  t = time.monotonic()
  gen_s = make_jpegs(os.path.join(a.work, "data"), a.e2e_images)
  rep.phase("jpegs", time.monotonic() - t)
  rep.log(f"generated {len(CORRUPTIONS) * a.e2e_images} JPEGs in {gen_s:.1f} s")

  t = time.monotonic()
  order = run_order(names)
  jobs = [f"{m}:{d}" for m in order for d in ("float32", "bfloat16")]
  rep.data["results"]["torch"] = run_batched(rep, "torch", jobs, sizes, min(a.torch_s, rep.left() - a.reserve_s))
  rep.phase("torch", time.monotonic() - t)

  t = time.monotonic()
  attention = "matmul" if a.no_cudnn else "auto"  # bf16's; float32 always runs the default, auto
  jobs = [f"{m}:{d}" for m in order for d in ("float32:auto", f"bfloat16:{attention}")]
  jax_res = run_batched(rep, "jax", jobs, sizes, rep.left() - a.e2e_s)
  rep.data["results"]["jax"] = jax_res
  rep.phase("jax", time.monotonic() - t)

  # The e2e runs the harness with the kernel the bf16 steps ran with (auto, unless cuDNN refused: matmul).
  used = [r.get("attention") for k, r in jax_res.items() if ":bfloat16:" in k and "error" not in r]
  e2e_attention = attention if used and "matmul" not in used else "matmul"
  t = time.monotonic()
  e2e_methods = [m for m in a.e2e_methods.split(",") if m in names]
  if e2e_methods and rep.left() > 20:
    rep.data["results"]["e2e"] = rep.run_worker("e2e", e2e_methods, rep.left() - 5,
                                                ["--dtype", "bfloat16", "--attention", e2e_attention])
  rep.phase("e2e", time.monotonic() - t)

  t = time.monotonic()
  if attention == "auto" and rep.left() > 30:  # what the resolved kernels buy over matmul, on the cheapest
    extra = [f"{m}:{d}:matmul" for m in ("source", "tent") if m in names for d in ("bfloat16", "float32")]
    jax_res.update(run_batched(rep, "jax", extra, sizes, rep.left() - 5))
    rep.phase("extras", time.monotonic() - t)
  out = finish(rep, names, attention)
  if own_work and not a.keep:
    shutil.rmtree(a.work, ignore_errors=True)
  return out


def finish(rep: Report, names: list[str], attention: str) -> int:
  a = rep.a
  md = tables(rep, names, attention)
  print("\n" + md, flush=True)
  rep.data["total_s"] = time.monotonic() - rep.t0
  if a.out:
    rep.save()
    with open(os.path.join(a.out, "report.md"), "w") as f:
      f.write(md)
    for name in ("prepare", "torch", "jax", "e2e"):
      log = os.path.join(a.work, f"{name}.log")
      if os.path.isfile(log):
        shutil.copy(log, os.path.join(a.out, f"{name}.log"))
    print(f"wrote {a.out}/report.json, report.md and the workers' logs", flush=True)
  return 0


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="gpu_report.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="ViT-Ti/32, batch 4, 1 step, 16 images per corruption: the whole pipeline on a CPU")
  p.add_argument("--arch", default="vit_base_patch16_224")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--methods", help="comma-separated (default: every registered method with a PyTorch reference)")
  p.add_argument("--fp32-matmul", default="tf32", choices=["tf32", "highest"])
  p.add_argument("--no-cudnn", action="store_true", help="bf16 with the matmul attention only")
  p.add_argument("--compile-threads", type=int, default=4, help="JAX steps compiled ahead in parallel")
  p.add_argument("--max-job-s", type=float, default=15.0,
                 help="each step's warm-up and timing stop after this long (at least one timed step)")
  p.add_argument("--e2e-methods", default="source,tent", help="source: the fastest step, the hardest to feed")
  p.add_argument("--e2e-images", type=int, default=2560, help="generated JPEGs per corruption (2 corruptions)")
  p.add_argument("--budget-s", type=float, default=390.0, help="wall-clock budget of the whole report")
  p.add_argument("--torch-s", type=float, default=120.0, help="at most this long for the PyTorch phase")
  p.add_argument("--e2e-loader", default="processes", choices=["threads", "processes"],
                 help="the harness's --loader in the end-to-end phase (threads stop scaling at the GIL)")
  p.add_argument("--e2e-s", type=float, default=100.0, help="time kept for the end-to-end phase")
  p.add_argument("--reserve-s", type=float, default=200.0, help="time the torch phase leaves for JAX and e2e")
  p.add_argument("--out", default=os.environ.get("OUT"), help="where report.json/.md go (default: $OUT)")
  p.add_argument("--work", help="scratch dir (default: a temporary one, removed)")
  p.add_argument("--keep", action="store_true", help="keep the scratch dir")
  p.add_argument("--worker", choices=["prepare", "torch", "jax", "e2e"], help=argparse.SUPPRESS)
  p.add_argument("--jobs", help=argparse.SUPPRESS)
  p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
  p.add_argument("--attention", default="auto", help=argparse.SUPPRESS)
  p.add_argument("--part", choices=sorted(PARTS), help="one of the report's three parts (module docstring)")
  p.add_argument("--batch-sizes", help="per-method batch sizes, e.g. memo=16")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  if a.worker:
    {"prepare": worker_prepare, "torch": worker_torch, "jax": worker_jax, "e2e": worker_e2e}[a.worker](a)
    return 0
  return driver(a)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
