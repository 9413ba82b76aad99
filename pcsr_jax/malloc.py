"""The allocator under which XLA:CPU stops faulting in its step buffers, set by re-executing the command.

XLA:CPU allocates each execution's temporaries as one block per device (463 MB for a ViT-S/16 TENT step at
batch 16 on each of 2 devices, 0.86 GiB for ETA's, whose forward keeps what a backward would need), with
``posix_memalign`` from one of its worker threads. glibc serves a block that large with ``mmap`` and unmaps
it when the step ends: every step faults in and zeroes its whole working memory again (226,000 page faults
per TENT step on 2 cores, where PyTorch's step, many blocks of a few MB that glibc's heap keeps, has 21,000).
``PCSR_JAX_MALLOC`` picks the allocator (docs/performance.md, "The allocator on a CPU host", has the figures):

* ``mimalloc`` (the default where it is installed: ``cmeel-mimalloc``, a dependency on x86-64 Linux):
  Microsoft's mimalloc, preloaded (``LD_PRELOAD``). It keeps freed memory a few milliseconds before giving it
  back, so a step takes the previous step's pages again: kernel time per step 0.02 s for ViT-S/16 ETA at
  batch 16 (``hugepages`` 0.13, glibc's own 0.65), 0.21 s for TENT at batch 64 (``hugepages`` 1.69), at the
  same peak memory (4.4 GB either way). JAX's EATA and DeYO steps at batch 16 went from 0.85-0.90x PyTorch's
  to 0.98-1.03x. `MIMALLOC_OPTIONS` lets it keep blocks of any size: under its 2 GiB default a ViT-B/16 ETA
  step at batch 64 (3.4 GiB of temporaries per device) spent 6.3 s of kernel time in its 15.8 s, 0.19 s (of
  12.7 s) with the option (`experiments/results/cpu/alloc_steps.md`).
* ``hugepages`` (the default where mimalloc is not installed): glibc asks for transparent huge pages on its
  mappings (``hugetlb=1``): 2 MiB faults, the same memory. The kernel still zeroes (and, with THP's usual
  ``defrag=madvise``, compacts memory for) every page of every step: 0.08-0.43 s of kernel time per ETA step
  at batch 16, 1.41-1.88 s per TENT step at batch 64 (11-15% of it; ``benchmarks/alloc_steps.py``).
* ``system``: glibc's defaults, nothing set, no restart.
* ``reuse``: glibc with one arena, no ``mmap``, no trimming: no faults once the heap has found room for a
  step's blocks (a few steps), at up to 3 times the memory at batch 64, where a single heap fragments.

The restart costs one more interpreter start per command. The loader reads ``LD_PRELOAD`` and glibc its
``GLIBC_TUNABLES`` once, at process start, so `reexec` starts the command again with them (its child
processes inherit them). It does so only on Linux with glibc where JAX will run on the CPU (no accelerator
plugin installed, or ``JAX_PLATFORMS=cpu``): on an accelerator host the step's memory is the device's. A
``GLIBC_TUNABLES`` that already sets a malloc tunable, or an ``LD_PRELOAD`` that already loads an allocator
(jemalloc, tcmalloc, mimalloc), is left as it is: the user's own choice wins.
"""

from __future__ import annotations

import functools
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
MIMALLOC = "mimalloc"
# The glibc modes' tunables (None: glibc's own); `MIMALLOC` preloads a library instead.
MODES: dict[str, Optional[str]] = {MIMALLOC: None, "hugepages": HUGEPAGES, "reuse": REUSE, "system": None}
ENV = "PCSR_JAX_MALLOC"
MIMALLOC_DIST = "cmeel-mimalloc"  # the wheel that ships libmimalloc.so
# mimalloc's own settings under `MIMALLOC` (environment variables; a value the user set is kept). mimalloc serves
# a block above ``arena_max_object_size`` (2 GiB in 3.x) straight from the OS, mapped and unmapped on every
# allocation: XLA:CPU's step blocks beyond that size (3.4 GiB per device for ViT-B/16 ETA at batch 64) were
# faulted in and zeroed again at every step. 1 TiB: any block a host's memory can hold comes from mimalloc's
# arenas, which keep it for the next step.
MIMALLOC_OPTIONS = {"MIMALLOC_ARENA_MAX_OBJECT_SIZE": "1024GiB"}
FALLBACK = "hugepages"  # the default where mimalloc is not installed


def _accelerator_installed() -> bool:
  """Whether JAX could pick a GPU or TPU here: a PJRT plugin (jax-cuda*-plugin, ...) or libtpu installed."""
  return bool(importlib.metadata.entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu") is not None


def on_glibc() -> bool:
  """Whether this process runs on Linux with glibc, whose settings these are (elsewhere nothing is done)."""
  return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


@functools.cache
def mimalloc_library() -> Optional[str]:
  """The path of the installed ``libmimalloc.so.*`` (`MIMALLOC_DIST`), or None (looked up once per process:
  `tuned_env` asks up to three times at every command's start)."""
  try:
    files = importlib.metadata.files(MIMALLOC_DIST) or []
  except importlib.metadata.PackageNotFoundError:
    return None
  libs = sorted(str(f.locate()) for f in files if f.name.startswith("libmimalloc.so"))
  return next((lib for lib in libs if os.path.isfile(lib)), None)


def default_mode() -> str:
  """``mimalloc`` where it is installed, else `FALLBACK`."""
  return MIMALLOC if mimalloc_library() else FALLBACK


def mode(env: Mapping[str, str]) -> str:
  """The mode ``env`` asks for (``PCSR_JAX_MALLOC``, default `default_mode`); a `UserError` naming it if unknown."""
  m = env.get(ENV) or default_mode()
  if m not in MODES:
    raise UserError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
  return m


def preloaded_allocators(env: Mapping[str, str]) -> list[str]:
  """The allocator libraries ``env``'s ``LD_PRELOAD`` loads (jemalloc, tcmalloc, mimalloc), by file name."""
  preloaded = [os.path.basename(p) for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
  return [p for p in preloaded if "malloc" in p]


def users_own(env: Mapping[str, str]) -> bool:
  """Whether ``env`` already picks the allocator: a glibc malloc tunable, or a preloaded allocator library."""
  return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or bool(preloaded_allocators(env))


def tunables(env: Mapping[str, str]) -> Optional[str]:
  """The glibc malloc tunables a process started with ``env`` should get: those of its glibc `mode` on glibc
  with CPU-only JAX, unless the allocator is the user's own (`users_own`); else None."""
  wanted = MODES[mode(env)]
  if wanted is None or not on_glibc() or users_own(env):
    return None
  return wanted if cpu_only(env) else None


def preload(env: Mapping[str, str]) -> Optional[str]:
  """The allocator library a process started with ``env`` should preload: mimalloc's where its `mode` is
  ``mimalloc``, on glibc with CPU-only JAX, unless the allocator is the user's own; else None. Asked for by
  name and not installed: a `UserError`."""
  if mode(env) != MIMALLOC or not on_glibc() or users_own(env) or not cpu_only(env):
    return None
  lib = mimalloc_library()
  if lib is None:
    others = ", ".join(m for m in MODES if m != MIMALLOC)
    raise UserError(f"{ENV}={MIMALLOC}: {MIMALLOC_DIST} is not installed (pip install {MIMALLOC_DIST}), or "
                    f"choose one of {others}")
  return lib


def cpu_only(env: Mapping[str, str]) -> bool:
  """Whether JAX, started with ``env``, can only run on the CPU: ``JAX_PLATFORMS=cpu``, or no platform asked
  for and no GPU or TPU plugin installed. Decided without starting JAX."""
  platforms = env.get("JAX_PLATFORMS", "")
  return platforms == "cpu" or (not platforms and not _accelerator_installed())


def tuned_env(env: Mapping[str, str]) -> dict[str, str]:
  """``env`` with `tunables` added to ``GLIBC_TUNABLES``, or `preload`'s library to ``LD_PRELOAD`` and
  `MIMALLOC_OPTIONS` (the user's other entries, and any of those options the user set, kept)."""
  out = dict(env)
  extra, lib = tunables(env), preload(env)
  if extra:
    out["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES", ""), extra)))
  if lib:
    out["LD_PRELOAD"] = ":".join(filter(None, (lib, env.get("LD_PRELOAD", ""))))
    out.update({k: v for k, v in MIMALLOC_OPTIONS.items() if k not in env})
  return out


def reexec(environ: Mapping[str, str] = os.environ) -> None:
  """Replaces this process with the same command line under `tunables` or `preload`, where wanted; else
  returns. Call first thing in a command (before JAX starts, so nothing is lost); the new process finds the
  settings in its environment and goes on. An unknown ``PCSR_JAX_MALLOC`` raises `UserError` (`cli.run_cli`:
  one line)."""
  env = tuned_env(environ)
  if env == dict(environ):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)
