"""glibc malloc settings under which XLA:CPU reuses its per-step buffers, set by re-executing the command.

XLA:CPU allocates each execution's temporaries as one block per device (463 MB for a ViT-S/16 TENT step at
batch 16 on each of 2 devices), with ``posix_memalign`` from one of its worker threads. glibc serves that
request from the thread's own arena, which cannot hold a block over 64 MB, so it maps fresh pages and unmaps
them when the step ends: every step faults in and zeroes its whole working memory again (226,000 page faults
and 0.4 s of kernel time per step on 2 cores, where PyTorch's step has 21,000). With one arena, no ``mmap``
and no trimming, the freed block stays in the heap and the next step takes it back: no faults, and the same
arithmetic (``PCSR_JAX_MALLOC=system`` against the default: README, "glibc's malloc on a CPU host").

glibc reads these settings (``GLIBC_TUNABLES``) once, at process start, so `reexec` starts the command again
with them. It does so only where JAX will run on the CPU (no accelerator plugin installed, or
``JAX_PLATFORMS=cpu``): on an accelerator host the step's memory is the device's, and one arena would only
serialize the decoding threads' allocations. ``PCSR_JAX_MALLOC=system`` keeps glibc's defaults; a
``GLIBC_TUNABLES`` that already sets a malloc tunable is left as it is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Mapping

# One arena (the main one, whose heap can grow to any size), never mmap, never give the top of the heap back.
TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
OPT_OUT = "PCSR_JAX_MALLOC"


def _accelerator_installed() -> bool:
  """Whether JAX could pick a GPU or TPU here: a PJRT plugin (jax-cuda*-plugin, ...) or libtpu installed."""
  return bool(importlib.metadata.entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu") is not None


def on_glibc() -> bool:
  """Whether this process runs on Linux with glibc, whose settings these are (elsewhere nothing is done)."""
  return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def wanted(env: Mapping[str, str]) -> bool:
  """Whether a process started with ``env`` should get `TUNABLES`: glibc, CPU-only JAX, not opted out, and
  not set already (by us or by the user)."""
  if env.get(OPT_OUT, "tuned") == "system":
    return False
  if not on_glibc():
    return False
  if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
    return False
  platforms = env.get("JAX_PLATFORMS", "")
  return platforms == "cpu" or (not platforms and not _accelerator_installed())


def tuned_env(env: Mapping[str, str]) -> dict[str, str]:
  """``env`` with `TUNABLES` added to ``GLIBC_TUNABLES`` (where `wanted`)."""
  out = dict(env)
  if wanted(env):
    out["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES", ""), TUNABLES)))
  return out


def reexec(environ: Mapping[str, str] = os.environ) -> None:
  """Replaces this process with the same command line under `TUNABLES`, where `wanted`; else returns. Call
  first thing in a command (before JAX starts, so nothing is lost); the new process finds the settings in its
  environment and goes on."""
  env = tuned_env(environ)
  if env.get("GLIBC_TUNABLES") == environ.get("GLIBC_TUNABLES"):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)
