"""Shared test set-up: float32 'highest' matmuls, tiny configs, and the torch marker."""

from __future__ import annotations

import importlib.util
import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# XLA's CPU compiles dominate this suite; a persistent cache lets identical programs (the same method
# rebuilt in another test, or in CI's second pass) skip recompiling. It changes no result.
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "PCSR_TEST_XLA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pcsr-jax", "xla-tests")))
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
