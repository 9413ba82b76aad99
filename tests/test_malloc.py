"""pcsr_jax.malloc: the allocators under which XLA:CPU stops faulting in its step buffers (each mode), and the
CLI restart that sets them."""

import json
import os
import subprocess
import sys

import pytest

from pcsr_jax import malloc
from pcsr_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = {"JAX_PLATFORMS": "cpu"}
pytestmark = pytest.mark.skipif(not malloc.on_glibc(), reason="glibc's settings: elsewhere nothing is done")


def test_each_mode_adds_its_setting_once_and_only_where_wanted():
  lib = malloc.mimalloc_library()
  assert lib and os.path.basename(lib).startswith("libmimalloc.so")  # a dependency on x86-64 Linux
  system = {**CPU, "PATH": "/bin", malloc.ENV: "system"}
  assert malloc.tuned_env(system) == system  # glibc's own: nothing added
  # The default on a CPU backend is mimalloc, preloaded (the user's other preloads kept, after it).
  default = malloc.tuned_env({**CPU, "PATH": "/bin"})
  assert default == {**CPU, "PATH": "/bin", "LD_PRELOAD": lib, "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "1024GiB"}
  assert malloc.tuned_env(default) == default  # the restarted process does not restart again
  assert malloc.tuned_env({**CPU, "LD_PRELOAD": "/x/libfoo.so"})["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"
  mine = {**CPU, "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "8GiB"}  # a mimalloc option the user set is kept
  assert malloc.tuned_env(mine) == {**mine, "LD_PRELOAD": lib}
  huge = {**CPU, malloc.ENV: "hugepages"}
  env = malloc.tuned_env(huge)
  assert env == {**huge, "GLIBC_TUNABLES": malloc.HUGEPAGES}
  assert malloc.tuned_env(env) == env
  assert malloc.tuned_env({**CPU, malloc.ENV: "reuse"})["GLIBC_TUNABLES"] == malloc.REUSE
  other = malloc.tuned_env({**huge, "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
  assert other["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX2:" + malloc.HUGEPAGES  # the user's other tunables kept
  # The user's own allocator wins: glibc malloc tunables, or a preloaded jemalloc.
  arenas = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
  for own in ({**huge, **arenas}, {**CPU, **arenas}, {**CPU, "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}):
    assert malloc.tuned_env(own) == own
  for mode in ("reuse", "mimalloc"):  # a GPU's memory is not malloc's
    assert malloc.tuned_env({"JAX_PLATFORMS": "cuda", malloc.ENV: mode}) == {"JAX_PLATFORMS": "cuda", malloc.ENV: mode}
  with pytest.raises(UserError, match="PCSR_JAX_MALLOC='tuned': expected one of mimalloc, hugepages, reuse, system"):
    malloc.tuned_env({**CPU, malloc.ENV: "tuned"})


def test_without_mimalloc_the_default_is_hugepages_and_asking_for_it_is_one_line(monkeypatch):
  monkeypatch.setattr(malloc, "mimalloc_library", lambda: None)  # as where the wheel is not installed
  assert malloc.default_mode() == "hugepages"
  assert malloc.tuned_env(dict(CPU)) == {**CPU, "GLIBC_TUNABLES": malloc.HUGEPAGES}
  with pytest.raises(UserError, match="^PCSR_JAX_MALLOC=mimalloc: cmeel-mimalloc is not installed"):
    malloc.tuned_env({**CPU, malloc.ENV: "mimalloc"})


# A CLI whose step has a 128 MiB temporary (h, between two dots): its page faults per call (the fewest of 4
# rounds of 5 calls, after 10: under the tunables glibc's heap takes a few calls to settle, then faults none),
# and the tunables it ran under. Run from the repository root (``python -c`` imports its pcsr_jax first).
_CLI = """
import json, os, resource, sys
from pcsr_jax.cli import run_cli

def main(argv):
  import jax, jax.numpy as jnp
  f = jax.jit(lambda x, w1, w2: (x @ w1) @ w2)
  x, w1, w2 = jnp.ones((32768, 64)), jnp.ones((64, 1024)), jnp.ones((1024, 1))
  for _ in range(10):
    f(x, w1, w2).block_until_ready()
  rounds = []
  for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
      f(x, w1, w2).block_until_ready()
    rounds.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
  maps = open("/proc/self/maps").read()
  print(json.dumps(dict(faults=min(rounds), tunables=os.environ.get("GLIBC_TUNABLES"), mimalloc="libmimalloc" in maps)))

run_cli(main, sys.argv[1:])
"""


# A CLI that allocates, touches (one byte per 4 KiB page) and frees a 2.5 GiB block 6 times: the page faults of
# each time after the first, and whether it runs under mimalloc.
_BIG_BLOCK = """
import json, resource, sys
from pcsr_jax.cli import run_cli

def main(argv):
  import numpy as np
  faults = []
  for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.empty(5 * 2**29, np.uint8)
    block[::4096] = 1
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  print(json.dumps(dict(faults=faults[1:], mimalloc="libmimalloc" in open("/proc/self/maps").read())))

run_cli(main, sys.argv[1:])
"""


def _run(extra_env: dict, script: str = _CLI) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", malloc.ENV) and not k.startswith("MIMALLOC_")}
  return subprocess.run([sys.executable, "-c", script], env={**env, **CPU, **extra_env}, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _faults(extra_env: dict, script: str = _CLI) -> dict:
  r = _run(extra_env, script)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


PAGES = 32768 * 1024 * 4 / 4096  # the temporary's 4 KiB pages


def _thp_mode() -> str:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return f.read().split("[")[1].split("]")[0]
  except (OSError, IndexError):
    return "never"


def test_cli_restarts_under_mimalloc_by_default_or_reuse_and_xla_stops_faulting_in_its_buffers():
  default = _faults({})
  reuse = _faults({malloc.ENV: "reuse"})
  system = _faults({malloc.ENV: "system"})  # no restart
  assert default["mimalloc"] and default["tunables"] is None
  assert reuse["tunables"] == malloc.REUSE and system["tunables"] is None
  assert not reuse["mimalloc"] and not system["mimalloc"]
  # Under glibc's defaults the temporary is mapped afresh on every call (with transparent huge pages, in 2 MiB
  # pages: 64 faults); kept by mimalloc or reused from glibc's heap, it faults almost no page after the first calls.
  assert system["faults"] >= 64
  for kept in (default, reuse):
    assert kept["faults"] < min(0.02 * PAGES, system["faults"] / 4), (kept, system)


def test_mimalloc_keeps_blocks_above_its_2_gib_arena_limit():
  # XLA:CPU's step block for ViT-B/16 ETA at batch 64 is 3.4 GiB per device. mimalloc's default hands a block
  # above 2 GiB back to the OS when freed (1,282 faults of 2 MiB pages, or 655,360 of 4 KiB, every time); the
  # default setting keeps it in an arena, so after the first time the block faults (almost) no page.
  kept = _faults({}, _BIG_BLOCK)
  assert kept["mimalloc"], kept
  assert max(kept["faults"]) < 64, kept  # a 2.5 GiB block is at least 1,280 pages


def test_cli_restarts_under_hugepages_and_faults_in_2_mib_pages():
  if _thp_mode() == "never":
    pytest.skip("this kernel has no transparent huge pages (glibc ignores hugetlb=1)")
  huge = _faults({malloc.ENV: "hugepages"})
  assert huge["tunables"] == malloc.HUGEPAGES and not huge["mimalloc"]
  # 64 huge pages (and some small ones for the step's other buffers) instead of 32,768 small ones; a kernel
  # that cannot find a free 2 MiB page falls back to small ones, hence the margin.
  assert huge["faults"] < 0.1 * PAGES, huge


def test_an_unknown_mode_is_one_line_and_exit_2():
  r = _run({malloc.ENV: "tuned"})
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr.strip().splitlines() == ["-c: error: PCSR_JAX_MALLOC='tuned': expected one of mimalloc, hugepages, "
                                           "reuse, system"], r.stderr
