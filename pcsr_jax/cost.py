"""What a method costs on the device a table runs on: its step's seconds per batch after compilation (median and 90th
percentile), images/s, compile time and memory, measured once per method (`probe`): on its first adapter, whose
compile it times and which its units then use (a Ray actor's on that actor's devices), or under ``--realtime`` for
every method before any unit runs, with its relative cost C (`pcsr_jax.realtime`). Every run records them:
results.json (``costs``), each record of results.csv, the cost table in table.md (`table`), the log and TensorBoard.

* **Time.** The step's first call (trace, compile, one step) is timed, then ``cost_batches`` more steps on the
  same batch, each waited for (`jax.block_until_ready`): ``compile_s`` is the first call less the median step.
  The step adapts as in the run (its state chained from the source state); the batch is the stream's first.
* **Memory.** ``peak_memory_bytes``: the device's ``memory_stats()['peak_bytes_in_use']`` where the backend keeps
  it (GPU, TPU), else the process's peak resident memory (``ru_maxrss``; a CPU), ``peak_memory_kind`` saying
  which. Both are peaks of the process so far, read right after the method's probe: the methods are probed one
  after another in the run's order, so a method's figure is at least the figures before it. The per-method
  figure is ``step_memory_bytes``: what XLA's compiled step needs (its arguments, outputs and temporaries, less
  the donated buffers it reuses: `memory_analysis`), on every backend.
* **Kept.** The figures (and C) are saved in ``<output>/resume/costs.json`` as each method is measured, so that
  ``--resume`` reuses them: a resumed run's schedule is the one it started with (bit-identical), and a method
  whose units are all done keeps its row in the cost table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from pcsr_jax import files

FILE = "costs.json"  # under the progress folder (`progress.Resume.dir`)
# The cost fields of a method, in results.csv's order after the accuracy fields.
FIELDS = ("step_s_median", "step_s_p90", "images_per_s", "compile_s", "peak_memory_bytes", "peak_memory_kind",
          "step_memory_bytes", "devices", "cost_batches", "realtime_c", "realtime_c_from", "adapted_batches", "batches")


def peak_memory(device: Any = None) -> tuple[int, str]:
  """``(bytes, kind)``: the device's peak bytes in use where its backend reports it, else the process's peak
  resident memory (a CPU)."""
  import jax

  device = device if device is not None else jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # a backend without allocator statistics
    stats = None
  if stats and stats.get("peak_bytes_in_use"):
    return int(stats["peak_bytes_in_use"]), f"device peak_bytes_in_use ({device.platform})"
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS (CPU)"


def step_memory(compiled: Any) -> Optional[int]:
  """The bytes XLA's compiled step uses: arguments + outputs + temporaries - donated buffers it aliases (None
  where the backend gives no memory analysis)."""
  try:
    m = compiled.memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def summarize(first_s: float, step_s: Sequence[float], batch_size: int) -> dict:
  """The time fields from a first call and the timed steps after it."""
  step_s = np.asarray(step_s, np.float64)
  median = float(np.median(step_s))
  return dict(step_s_median=median, step_s_p90=float(np.percentile(step_s, 90)), images_per_s=batch_size / median,
              compile_s=max(first_s - median, 0.0), cost_batches=int(len(step_s)))


def probe(adapter: Any, placed: tuple, batches: int, predict: bool = False) -> dict:
  """Times ``adapter``'s step on the batch ``placed`` (`Adapter.place`): its first call (compilation), then
  ``batches`` steps, each waited for; then its memory. ``predict`` also compiles the forward-only prediction
  (`Adapter.predict_placed`, `--realtime`), so that the run's first skipped batch does not compile it."""
  import jax

  state = adapter.init_state()
  t = time.perf_counter()
  state, logits, _ = adapter.step_placed(state, placed)
  jax.block_until_ready((state, logits))
  first = time.perf_counter() - t
  times = []
  for _ in range(batches):
    t = time.perf_counter()
    state, logits, _ = adapter.step_placed(state, placed)
    jax.block_until_ready((state, logits))
    times.append(time.perf_counter() - t)
  if predict:
    jax.block_until_ready(adapter.predict_placed(state, placed))
  out = summarize(first, times, adapter.batch_size)
  out["step_memory_bytes"] = step_memory(adapter.lower(state, placed).compile())  # compiled already: cached
  out["peak_memory_bytes"], out["peak_memory_kind"] = peak_memory(adapter.mesh.devices.flat[0])
  out["devices"] = describe_devices(list(adapter.mesh.devices.flat))  # a Ray actor's own, not its driver's
  return out


def load(resume_dir: str) -> dict:
  """The costs saved with the progress (``{method: fields}``; empty when none)."""
  try:
    with open(os.path.join(resume_dir, FILE)) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}


def save(resume_dir: str, costs: dict) -> None:
  os.makedirs(resume_dir, exist_ok=True)
  files.write_json(os.path.join(resume_dir, FILE), costs)


def with_costs(records: Sequence[dict], costs: dict) -> list[dict]:
  """Each record with its method's cost fields (results.json's and results.csv's rows)."""
  out = []
  for r in records:
    c = costs.get(r["method"], {})
    out.append(dict(r, **{k: c[k] for k in FIELDS if k in c and k not in ("adapted_batches", "batches")}))
  return out


def _mib(b: Optional[int]) -> str:
  return "-" if b is None else f"{b / 2 ** 20:.0f}"


def table(costs: dict, methods: Sequence[str], origin: Optional[dict] = None) -> str:
  """The cost table (markdown), a row per method: the step's median and 90th-percentile ms per batch, images/s,
  compile seconds, peak and step memory (MiB), and under ``--realtime`` C and the batches adapted on. Its caption
  names the devices each method was measured on (this process's where a cost predates that field), and with
  ``origin`` (``{method: run}``, `merge_results`) the run each row comes from."""
  rows = [m for m in methods if m in costs]
  if not rows:
    return ""
  kinds = sorted({costs[m].get("peak_memory_kind", "") for m in rows} - {""})
  rt = any(costs[m].get("realtime_c") for m in rows)
  head = "| Method | step ms (median) | step ms (p90) | img/s | compile s | peak MiB | step MiB |"
  head += " C | adapted batches |" if rt else ""
  lines = [head, "|" + "---|" * (7 + 2 * rt)]
  for m in rows:
    c = costs[m]
    line = (f"| {m} | {1e3 * c['step_s_median']:.1f} | {1e3 * c['step_s_p90']:.1f} | {c['images_per_s']:.0f} | "
            f"{c['compile_s']:.1f} | {_mib(c.get('peak_memory_bytes'))} | {_mib(c.get('step_memory_bytes'))} |")
    if rt:
      src = " (fixed)" if c.get("realtime_c_from") == "--realtime-cost" else ""
      line += f" {c.get('realtime_c', '-')}{src} | {c.get('adapted_batches', '-')} of {c.get('batches', '-')} |"
    lines.append(line)
  n = {costs[m].get("cost_batches") for m in rows}
  where = {}  # devices -> the methods measured there
  for m in rows:
    where.setdefault(costs[m].get("devices") or ("devices not recorded" if origin else describe_devices()),
                     []).append(m)
  on = next(iter(where)) if len(where) == 1 else "; ".join(f"{d} ({', '.join(ms)})" for d, ms in where.items())
  if origin:
    runs: dict = {}
    for m in rows:
      runs.setdefault(origin[m], []).append(m)
    on += "; rows from " + "; ".join(f"{r} ({', '.join(ms)})" for r, ms in runs.items())
  note = (f"\nCost of each method's step on {on}: after compilation, over "
          f"{'/'.join(map(str, sorted(x for x in n if x)))} timed steps on the stream's first batch; peak memory: "
          f"{', '.join(kinds) or '-'} (the process's peak so far, methods measured in this order); step memory: "
          f"XLA's compiled step (arguments, outputs, temporaries).\n")
  return "\n".join(lines) + "\n" + note


def describe_devices(devices: Optional[Sequence[Any]] = None) -> str:
  """``"N x kind"`` of ``devices`` (default: this process's local devices)."""
  if devices is None:
    import jax

    devices = jax.local_devices()
  return f"{len(devices)} x {devices[0].device_kind}" if devices else "no device"


def log_lines(method: str, c: dict) -> str:
  """The log's line for a method's measured cost."""
  line = (f"{method}: step {1e3 * c['step_s_median']:.1f} ms median, {1e3 * c['step_s_p90']:.1f} ms p90 "
          f"({c['images_per_s']:.0f} img/s) over {c['cost_batches']} steps after compiling in {c['compile_s']:.1f} s; "
          f"peak memory {_mib(c.get('peak_memory_bytes'))} MiB ({c.get('peak_memory_kind')}), step memory "
          f"{_mib(c.get('step_memory_bytes'))} MiB")
  if c.get("realtime_c"):
    line += f"; --realtime C = {c['realtime_c']} ({c.get('realtime_c_from')})"
  return line
