"""pcsr_jax.malloc: the glibc settings under which XLA:CPU reuses its step buffers, and the CLI restart that
sets them."""

import json
import os
import subprocess
import sys

import pytest

from pcsr_jax import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = {"JAX_PLATFORMS": "cpu"}
pytestmark = pytest.mark.skipif(not malloc.on_glibc(), reason="glibc's settings: elsewhere nothing is done")


def test_tunables_added_once_and_only_where_wanted():
  env = malloc.tuned_env({**CPU, "PATH": "/bin"})
  assert env["GLIBC_TUNABLES"] == malloc.TUNABLES and env["PATH"] == "/bin"
  assert malloc.tuned_env(env) == env  # the restarted process does not restart again
  other = malloc.tuned_env({**CPU, "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
  assert other["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX2:" + malloc.TUNABLES  # the user's other tunables kept
  own = {**CPU, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
  assert malloc.tuned_env(own) == own  # the user's own malloc settings win
  assert not malloc.wanted({**CPU, malloc.OPT_OUT: "system"})
  assert not malloc.wanted({"JAX_PLATFORMS": "cuda"})  # an accelerator's memory is not malloc's


# A CLI whose step has a 128 MiB temporary (h, between two dots): its page faults per call (the fewest of 4
# rounds of 5 calls, after 10: under the tunables glibc's heap takes a few calls to settle, then faults none),
# and the tunables it ran under.
_CLI = """
import json, os, resource, sys
sys.path.insert(0, {root!r})
from pcsr_jax.errors import run_cli

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


def _faults(extra_env: dict) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", malloc.OPT_OUT)}
  r = subprocess.run([sys.executable, "-c", _CLI.format(root=ROOT)], env={**env, **CPU, **extra_env},
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_cli_restarts_under_the_tunables_and_xla_stops_faulting_in_its_buffers():
  pages = 32768 * 1024 * 4 / 4096  # the temporary's 4 KiB pages
  tuned = _faults({})
  system = _faults({malloc.OPT_OUT: "system"})
  assert tuned["tunables"] == malloc.TUNABLES and system["tunables"] is None
  # Under glibc's defaults the temporary is mapped afresh on every call (with transparent huge pages, in 2 MiB
  # pages: 64 faults); reused, it faults no page at all after the first calls.
  assert system["faults"] >= 64
  assert tuned["faults"] < min(0.02 * pages, system["faults"] / 4), (tuned, system)
