"""`pcsr_jax.files`: a write that fails leaves the old file whole and no temporary behind."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pcsr_jax import files


def test_atomic_path_replaces_only_when_complete(tmp_path):
  path = str(tmp_path / "stats.npz")
  with files.atomic_path(path) as tmp:
    assert tmp.endswith(".npz") and tmp != path  # np.savez would append ".npz" to any other name
    np.savez(tmp, a=np.arange(3))
  assert np.load(path)["a"].tolist() == [0, 1, 2]
  with pytest.raises(RuntimeError):
    with files.atomic_path(path) as tmp:
      np.savez(tmp, a=np.arange(5))
      raise RuntimeError("interrupted")
  assert np.load(path)["a"].tolist() == [0, 1, 2]  # the old content, whole
  assert sorted(os.listdir(tmp_path)) == ["stats.npz"]  # and no temporary left


def test_write_json(tmp_path):
  path = str(tmp_path / "progress.json")
  files.write_json(path, {"batch": 3})
  files.write_json(path, {"batch": 4}, indent=1)
  with open(path) as f:
    assert json.load(f) == {"batch": 4}
  assert os.listdir(tmp_path) == ["progress.json"]
