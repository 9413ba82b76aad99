"""glibc malloc settings under which XLA:CPU stops faulting in its step buffers, set by re-executing the command.

XLA:CPU allocates each execution's temporaries as one block per device (463 MB for a ViT-S/16 TENT step at
batch 16 on each of 2 devices), with ``posix_memalign`` from one of its worker threads. glibc serves a block
that large with ``mmap`` and unmaps it when the step ends: every step faults in and zeroes its whole working
memory again, one 4 KiB page at a time (226,000 page faults per step on 2 cores, where PyTorch's step has
21,000). ``PCSR_JAX_MALLOC`` picks how (docs/performance.md, "glibc's malloc on a CPU host", has the
figures):

* ``hugepages`` (the default): glibc asks for transparent huge pages on its mappings (``hugetlb=1``), so the
  kernel maps the block in 2 MiB pages: far fewer faults, the same memory.
* ``system``: glibc's defaults, nothing set, no restart.
* ``reuse``: one arena, no ``mmap``, no trimming: the freed block stays in the heap and the next step takes it
  back, no faults at all once the heap has found room for a step's blocks (a few steps), at up to 3 times
  the memory at batch 64, where a single heap fragments.

Both speed up a small batch (batch 16: about 10% on JAX's TENT step); at the protocol's batch 64, in passes of
16 rows, neither is faster, and ``reuse``'s single heap fragments (up to 3 times the memory). ``hugepages``
costs no memory and no speed anywhere measured, so it is the default on a CPU backend: under ``system`` the
README's batch-16 step table did not hold (TENT 0.83x PyTorch, SAR 0.79x), under ``hugepages`` it does
(1.05x, 1.04x; docs/performance.md). The restart costs one more interpreter start per command. glibc reads these settings (``GLIBC_TUNABLES``) once, at
process start, so `reexec` starts the command again with them. It does so only where JAX will run on the CPU
(no accelerator plugin installed, or ``JAX_PLATFORMS=cpu``): on an accelerator host the step's memory is the
device's. A ``GLIBC_TUNABLES`` that already sets a malloc tunable is left as it is; a kernel without
transparent huge pages ignores ``hugetlb``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Mapping, Optional

from pcsr_jax.errors import UserError

HUGEPAGES = "glibc.malloc.hugetlb=1"
# One arena (the main one, whose heap can grow to any size), never mmap, never give the top of the heap back.
REUSE = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
MODES: dict[str, Optional[str]] = {"hugepages": HUGEPAGES, "reuse": REUSE, "system": None}
ENV = "PCSR_JAX_MALLOC"
DEFAULT = "hugepages"


def _accelerator_installed() -> bool:
  """Whether JAX could pick a GPU or TPU here: a PJRT plugin (jax-cuda*-plugin, ...) or libtpu installed."""
  return bool(importlib.metadata.entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu") is not None


def on_glibc() -> bool:
  """Whether this process runs on Linux with glibc, whose settings these are (elsewhere nothing is done)."""
  return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def mode(env: Mapping[str, str]) -> str:
  """The mode ``env`` asks for (``PCSR_JAX_MALLOC``, default `DEFAULT`); a `UserError` naming it if unknown."""
  m = env.get(ENV, DEFAULT)
  if m not in MODES:
    raise UserError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
  return m


def tunables(env: Mapping[str, str]) -> Optional[str]:
  """The malloc tunables a process started with ``env`` should get: those of its `mode` on glibc with
  CPU-only JAX, unless ``GLIBC_TUNABLES`` already sets one (the user's own win); else None."""
  wanted = MODES[mode(env)]
  if wanted is None or not on_glibc() or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
    return None
  return wanted if cpu_only(env) else None


def cpu_only(env: Mapping[str, str]) -> bool:
  """Whether JAX, started with ``env``, can only run on the CPU: ``JAX_PLATFORMS=cpu``, or no platform asked
  for and no GPU or TPU plugin installed. Decided without starting JAX."""
  platforms = env.get("JAX_PLATFORMS", "")
  return platforms == "cpu" or (not platforms and not _accelerator_installed())


def tuned_env(env: Mapping[str, str]) -> dict[str, str]:
  """``env`` with `tunables` added to ``GLIBC_TUNABLES`` (the user's other tunables kept)."""
  out = dict(env)
  extra = tunables(env)
  if extra:
    out["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES", ""), extra)))
  return out


def reexec(environ: Mapping[str, str] = os.environ) -> None:
  """Replaces this process with the same command line under `tunables`, where wanted; else returns. Call
  first thing in a command (before JAX starts, so nothing is lost); the new process finds the settings in its
  environment and goes on. An unknown ``PCSR_JAX_MALLOC`` raises `UserError` (`cli.run_cli`: one line)."""
  env = tuned_env(environ)
  if env.get("GLIBC_TUNABLES") == environ.get("GLIBC_TUNABLES"):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)
