"""Source statistics: computed once over the chosen images, cached with a checksum, rebuilt when stale or edited."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import ClassVar, Optional

import jax
import numpy as np
import pytest

import tiny
from pcsr_jax import source_stats
from pcsr_jax.data import transforms
from pcsr_jax.data.fmnist_c import ArraySource
from pcsr_jax.errors import UserError
from pcsr_jax.methods.source import Source


@dataclasses.dataclass(frozen=True)
class MeanLogits(Source):
  """A method whose statistics are the mean logits and the label histogram of what it was shown."""

  name: ClassVar[str] = "mean-logits"
  source_data: ClassVar[str] = "required"
  source_images: ClassVar[Optional[int]] = 24
  calls: ClassVar[list] = []

  def compute_source_stats(self, prep, frozen, trainable, batches):
    MeanLogits.calls.append(1)
    total, n, hist = 0.0, 0, np.zeros(10, np.int64)
    for images, labels in batches:
      total = total + np.asarray(self.forward(prep, frozen, trainable, images)[0], np.float64).sum(0)
      n += len(images)
      hist += np.bincount(labels, minlength=10)
    return {"mean": total / n, "labels": hist, "count": np.asarray(n)}


def _data(n=40, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  src = ArraySource(images, rng.integers(0, 10, n), 10)
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, "none")
  return source_stats.SourceData("test", f"test images ({n})", src, pre), pre


def _get(tmp_path, data, method=None, **kw):
  model, params = tiny.tiny_model()
  return source_stats.get(method or MeanLogits(), model, params, data, checkpoint_dir=str(tmp_path / "ckpt"),
                          output_dir=str(tmp_path / "out"), batch_size=8, progress=False, log=lambda *a: None, **kw)


def test_computed_over_the_chosen_images_and_cached(tmp_path):
  data, pre = _data()
  MeanLogits.calls.clear()
  stats, desc = _get(tmp_path, data)
  assert len(MeanLogits.calls) == 1 and int(stats["count"]) == 24 == desc["images"]
  # The same 24 images (seeded choice) as a direct computation over them.
  model, params = tiny.tiny_model()
  idx = source_stats.select(MeanLogits(), data)
  assert len(set(idx.tolist())) == 24
  x = np.stack([pre(data.source.load(i)) for i in idx])
  direct = np.asarray(model.apply({"params": params}, x), np.float64).mean(0)
  np.testing.assert_allclose(stats["mean"], direct, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(stats["labels"], np.bincount(data.source.labels[idx], minlength=10))
  again, _ = _get(tmp_path, data)
  assert len(MeanLogits.calls) == 1  # from the cache
  np.testing.assert_array_equal(again["mean"], stats["mean"])
  files = sorted(os.listdir(str(tmp_path / "ckpt") + ".source_stats"))
  assert [f.split(".")[-1] for f in files] == ["json", "npz"]
  # --source-images caps the count, and is another cache entry.
  capped, _ = _get(tmp_path, data, limit=10)
  assert int(capped["count"]) == 10 and len(MeanLogits.calls) == 2


def test_edited_or_stale_cache_is_rebuilt(tmp_path):
  data, _ = _data()
  MeanLogits.calls.clear()
  stats, _ = _get(tmp_path, data)
  d = str(tmp_path / "ckpt") + ".source_stats"
  npz = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".npz")][0]
  np.savez(npz, mean=stats["mean"] + 1, labels=stats["labels"], count=stats["count"])  # edited by hand
  rebuilt, _ = _get(tmp_path, data)
  assert len(MeanLogits.calls) == 2
  np.testing.assert_array_equal(rebuilt["mean"], stats["mean"])
  with open(npz, "r+b") as f:  # truncated
    f.truncate(10)
  _get(tmp_path, data)
  assert len(MeanLogits.calls) == 3
  # Other data (one label changed) or another checkpoint: other statistics, never the cached ones.
  data.source.labels = data.source.labels.copy()
  data.source.labels[source_stats.select(MeanLogits(), data)[0]] += 1
  _get(tmp_path, data)
  assert len(MeanLogits.calls) == 4
  model, params = tiny.tiny_model()
  params["head"]["bias"] = params["head"]["bias"] + 1
  source_stats.get(MeanLogits(), model, params, data, checkpoint_dir=str(tmp_path / "ckpt"),
                   output_dir=str(tmp_path / "out"), batch_size=8, progress=False, log=lambda *a: None)
  assert len(MeanLogits.calls) == 5
  metas = [json.load(open(os.path.join(d, f))) for f in os.listdir(d) if f.endswith(".json")]
  assert len({m["describe"]["checkpoint_params"] for m in metas}) == 2


def test_unwritable_checkpoint_folder_falls_back_to_output(tmp_path):
  data, _ = _data()
  (tmp_path / "a_file").write_text("")  # <a_file>/ckpt.source_stats cannot be created, even by root
  model, params = tiny.tiny_model()
  source_stats.get(MeanLogits(), model, params, data, checkpoint_dir=str(tmp_path / "a_file" / "ckpt"),
                   output_dir=str(tmp_path / "out"), batch_size=8, progress=False, log=lambda *a: None)
  assert any(f.endswith(".npz") for f in os.listdir(tmp_path / "out" / "source_stats"))


def test_source_data_spec_errors(tmp_path):
  meta = dict(img_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bicubic")
  with pytest.raises(UserError, match="--source-data .*nowhere: not a folder"):
    source_stats.open_source_data(str(tmp_path / "nowhere"), meta)
  with pytest.raises(UserError, match="--source-data tfds:a:b:c"):
    source_stats.open_source_data("tfds:a:b:c", meta)


def test_adapter_refuses_a_required_method_without_statistics():
  from pcsr_jax import engine

  model, params = tiny.tiny_model()
  with pytest.raises(UserError, match="mean-logits: needs statistics of clean source data"):
    engine.Adapter(MeanLogits(), model, params, batch_size=4)
  stats = {"mean": np.zeros(10, np.float32)}
  ad = engine.Adapter(MeanLogits(), model, params, batch_size=4, source_stats=stats)
  assert isinstance(ad.consts["mean"], jax.Array)
