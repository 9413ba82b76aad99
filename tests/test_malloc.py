"""pcsr_jax.malloc: the glibc settings under which XLA:CPU stops faulting in its step buffers (each mode), and
the CLI restart that sets them."""

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


def test_each_mode_adds_its_tunables_once_and_only_where_wanted():
  system = {**CPU, "PATH": "/bin", malloc.ENV: "system"}
  assert malloc.tuned_env(system) == system  # glibc's own: nothing added
  # The default on a CPU backend is huge pages (the step table's batch-16 cells need them).
  assert malloc.tuned_env({**CPU, "PATH": "/bin"}) == {**CPU, "PATH": "/bin", "GLIBC_TUNABLES": malloc.HUGEPAGES}
  huge = {**CPU, malloc.ENV: "hugepages"}
  env = malloc.tuned_env(huge)
  assert env == {**huge, "GLIBC_TUNABLES": malloc.HUGEPAGES}
  assert malloc.tuned_env(env) == env  # the restarted process does not restart again
  assert malloc.tuned_env({**CPU, malloc.ENV: "reuse"})["GLIBC_TUNABLES"] == malloc.REUSE
  other = malloc.tuned_env({**huge, "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
  assert other["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX2:" + malloc.HUGEPAGES  # the user's other tunables kept
  own = {**huge, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
  assert malloc.tuned_env(own) == own  # the user's own malloc settings win
  assert malloc.tunables({"JAX_PLATFORMS": "cuda", malloc.ENV: "reuse"}) is None  # a GPU's memory is not malloc's
  with pytest.raises(UserError, match="PCSR_JAX_MALLOC='tuned': expected one of hugepages, reuse, system"):
    malloc.tuned_env({**CPU, malloc.ENV: "tuned"})


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
  print(json.dumps(dict(faults=min(rounds), tunables=os.environ.get("GLIBC_TUNABLES"))))

run_cli(main, sys.argv[1:])
"""


def _run(extra_env: dict) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", malloc.ENV)}
  return subprocess.run([sys.executable, "-c", _CLI], env={**env, **CPU, **extra_env}, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _faults(extra_env: dict) -> dict:
  r = _run(extra_env)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


PAGES = 32768 * 1024 * 4 / 4096  # the temporary's 4 KiB pages


def _thp_mode() -> str:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return f.read().split("[")[1].split("]")[0]
  except (OSError, IndexError):
    return "never"


def test_cli_restarts_under_reuse_and_xla_stops_faulting_in_its_buffers():
  reuse = _faults({malloc.ENV: "reuse"})
  system = _faults({malloc.ENV: "system"})  # no restart
  assert reuse["tunables"] == malloc.REUSE and system["tunables"] is None
  # Under glibc's defaults the temporary is mapped afresh on every call (with transparent huge pages, in 2 MiB
  # pages: 64 faults); reused, it faults no page at all after the first calls.
  assert system["faults"] >= 64
  assert reuse["faults"] < min(0.02 * PAGES, system["faults"] / 4), (reuse, system)


def test_cli_restarts_under_hugepages_by_default_and_faults_in_2_mib_pages():
  if _thp_mode() == "never":
    pytest.skip("this kernel has no transparent huge pages (glibc ignores hugetlb=1)")
  huge = _faults({})  # the default
  assert huge["tunables"] == malloc.HUGEPAGES
  # 64 huge pages (and some small ones for the step's other buffers) instead of 32,768 small ones; a kernel
  # that cannot find a free 2 MiB page falls back to small ones, hence the margin.
  assert huge["faults"] < 0.1 * PAGES, huge


def test_an_unknown_mode_is_one_line_and_exit_2():
  r = _run({malloc.ENV: "tuned"})
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr.strip().splitlines() == ["-c: error: PCSR_JAX_MALLOC='tuned': expected one of hugepages, reuse, "
                                           "system"], r.stderr
