"""Shared test set-up: float32 'highest' matmuls, tiny configs, and the torch marker."""

from __future__ import annotations

import importlib.util
import os

import jax
import pytest

# XLA's CPU compiles are most of this suite's time. LLVM at -O1 compiles them faster than the default -O2 (wall
# time of `tests/test_cotta.py::test_cotta_matches_the_official_style_reference`: 59.8 s at -O2, 48.4 s at -O1)
# and, unlike -O0, keeps the code it makes fast enough for the tests that run many steps (DDA's diffusion steps
# in `tests/test_baselines_harness.py::test_state_resumes_bit_identically_from_the_host_copy[dda]`: 32 s alone
# at -O1 or -O2, 282 s at -O0 in a full run). XLA's HLO passes are the same at every level; LLVM's code
# generation may round the last bits differently (PCSR's logits on the tiny model: 1e-5 apart), which the
# tests' stated tolerances cover: they compare floats across programs with tolerances and assert bit-identity
# only between programs of one run, all at one level. Subprocesses inherit it; a level already in XLA_FLAGS is
# kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                   "--xla_backend_optimization_level=1"]))
jax.config.update("jax_default_matmul_precision", "highest")
# Ray (`tests/test_ray_units.py`'s local clusters, the CLI runs with --executor ray): every node on 127.0.0.1,
# never the address of the interface that routes outside. Ray reads it when imported, so before any test does.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# A persistent compile cache lets identical programs (the same method rebuilt in another test, or in CI's second
# pass) skip recompiling. It changes no result.
# The CLI runs that tests start as subprocesses use the same cache through JAX's environment variables (a
# killed and resumed run, the multi-process runs: the same programs compiled once).
_CACHE = os.environ.get("PCSR_TEST_XLA_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "pcsr-jax", "xla-tests"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _have_torch() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "timm", "cma"))


def pytest_configure(config):
  if os.environ.get("PCSR_REQUIRE_TORCH") == "1" and not _have_torch():
    raise pytest.UsageError("PCSR_REQUIRE_TORCH=1 but torch/timm cannot be imported")


def pytest_collection_modifyitems(config, items):
  if _have_torch():
    return
  skip = pytest.mark.skip(reason="needs torch and timm (pip install -e '.[convert]')")
  for item in items:
    if "torch" in item.keywords:
      item.add_marker(skip)
