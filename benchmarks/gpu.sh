#!/usr/bin/env bash
# One-shot GPU report (issue 14): JAX vs PyTorch step img/s per method in float32 and bf16, and the end-to-end
# harness on generated JPEGs. Installs nothing: it uses the python3 found (jax with CUDA, torch, timm, flax,
# optax, orbax) and this checkout (`python -m benchmarks.gpu_report`, from its root). Writes report.json,
# report.md and logs to $OUT if set.
#
#   bash benchmarks/gpu.sh --part A        # on the GPU machine: part A of three (A, B, C), at most 450 s each,
#   bash benchmarks/gpu.sh --part B        #   one GPU command each (ViT-B/16, batch 64; gpu_report's docstring)
#   bash benchmarks/gpu.sh --part C        #   (C: MEMO at batch 16); report.json is written as results come
#   bash benchmarks/gpu.sh                 # every method in one command (budget 390 s: not all of them finish)
#   bash benchmarks/gpu.sh --cpu-smoke --part A   # dry run of a part on a CPU (ViT-Ti, batch 4, 1 step)
#
# Extra flags go to benchmarks/gpu_report.py (e.g. --methods source,tent --budget-s 300).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
echo "== $(date -u +%FT%TZ) $(hostname) $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/{print $2" GiB"}')"
command -v nvidia-smi >/dev/null && nvidia-smi -L && \
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
"$PY" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "torch", "timm", "safetensors", "numpy", "PIL",
             "tqdm", "matplotlib", "tensorflow_datasets"):
  try:
    m = importlib.import_module(name)
    print(f"  {name} {getattr(m, '__version__', '?')}")
  except Exception as e:
    print(f"  {name}: not available ({type(e).__name__})")
try:
  import jax
  print("  jax devices:", jax.devices())
except Exception as e:
  print("  jax devices: failed:", e)
PY
# A carried .whl/ (e.g. pycma for FOA's PyTorch reference, pure Python) is installed aside, never from the network.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pcsr_site .whl/*.whl && \
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/pcsr_site"
fi
# One step of the report never waits on another framework's memory: the workers run one at a time, JAX with its
# default preallocation. The whole report has a hard limit just under the device's 10-minute command limit.
exec timeout --signal=TERM --kill-after=10 570 "$PY" -m benchmarks.gpu_report "$@"
