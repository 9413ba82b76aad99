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
from pcsr_jax import files, source_stats
from pcsr_jax.data import transforms
from pcsr_jax.data.generators.fmnist_c import ArraySource
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

  def source_stats_shapes(self, prep, frozen, trainable):
    c = prep.model.config.num_classes
    return {"mean": jax.ShapeDtypeStruct((c,), np.float64), "labels": jax.ShapeDtypeStruct((10,), np.int64),
            "count": jax.ShapeDtypeStruct((), np.asarray(0).dtype)}


def _data(n=40, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  src = ArraySource(images, rng.integers(0, 10, n), 10)
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, "none")
  return source_stats.SourceData("test", f"test images ({n})", src, pre), pre


def _get(tmp_path, data, method=None, **kw):
  model, params = tiny.tiny_model()
  kw.setdefault("log", lambda *a: None)
  return source_stats.get(method or MeanLogits(), model, params, data, checkpoint_dir=str(tmp_path / "ckpt"),
                          output_dir=str(tmp_path / "out"), batch_size=8, progress=False, **kw)


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


def _folder(root, classes=2, per_class=10, seed=0):
  """``root/c<k>/<n>.JPEG`` (not wnids: labels 0..classes-1): a source folder whose files a test can break."""
  from PIL import Image

  rng = np.random.default_rng(seed)
  for c in range(classes):
    os.makedirs(root / f"c{c}", exist_ok=True)
    for k in range(per_class):
      Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{k:03d}.JPEG")
  meta = dict(img_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bicubic")
  return lambda: source_stats.open_source_data(str(root), meta)


def test_unreadable_source_images_are_counted_named_and_a_repair_is_seen(tmp_path):
  reopen = _folder(tmp_path / "src")
  victims = sorted((tmp_path / "src").rglob("*.JPEG"))[:5]
  good = {p: p.read_bytes() for p in victims}
  for p in victims:
    p.write_bytes(b"not a jpeg")
  MeanLogits.calls.clear()
  lines = []
  stats, desc = _get(tmp_path, reopen(), log=lines.append)
  assert int(stats["count"]) == 15 and desc["read"]["images"] == 15 and desc["read"]["skipped"] == 5
  assert desc["read"]["skipped_names"] == [os.path.join("c0", p.name) for p in victims]
  assert any("5 of 20 source images could not be read" in l and "c0/000.JPEG" in l for l in lines), lines
  note = source_stats.used_note(desc)
  assert note.startswith("15 images of folder") and "(5 of 20 unreadable, skipped: c0/000.JPEG" in note
  _, again = _get(tmp_path, reopen())  # from the cache: the same account of what was read
  assert len(MeanLogits.calls) == 1 and again["read"] == desc["read"]
  # The files repaired under the same names: other statistics (all 20 images), not the cached ones of 15.
  for p, data in good.items():
    p.write_bytes(data)
  stats, desc = _get(tmp_path, reopen())
  assert len(MeanLogits.calls) == 2 and int(stats["count"]) == 20 and desc["read"]["skipped"] == 0


def test_no_readable_source_image_is_one_line(tmp_path):
  from pcsr_jax import methods

  reopen = _folder(tmp_path / "src", per_class=1)
  for p in (tmp_path / "src").rglob("*.JPEG"):
    p.write_bytes(b"not a jpeg")
  for method in (MeanLogits(), methods.get("foa")):  # FOA once divided by the zero images it had
    with pytest.raises(UserError, match=r"--source-data .*src: none of the 2 source images .* could be read "
                                        r"\(e.g. c0/000.JPEG, c1/000.JPEG\)"):
      _get(tmp_path, reopen(), method=method)
  (tmp_path / "src" / "c1" / "000.JPEG").unlink()
  (tmp_path / "src" / "c1").rmdir()
  os.remove(tmp_path / "src" / "c0" / "000.JPEG")
  _folder(tmp_path / "src", classes=1, per_class=1)
  with pytest.raises(UserError, match="foa: the source statistics need at least 2 source images, got 1"):
    _get(tmp_path, reopen(), method=methods.get("foa"))


def _entry(tmp_path):
  d = str(tmp_path / "ckpt") + ".source_stats"
  return os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".json")))[:-5]


@pytest.mark.parametrize("text", ["null", "[1, 2]", '{"describe": 3}'])
def test_cache_json_of_another_type_is_rebuilt(tmp_path, text):
  data, _ = _data()
  MeanLogits.calls.clear()
  _get(tmp_path, data)
  with open(_entry(tmp_path) + ".json", "w") as f:
    f.write(text)
  lines = []
  _get(tmp_path, data, log=lines.append)
  assert len(MeanLogits.calls) == 2 and any("is not a statistics description" in l for l in lines), lines


def test_cache_with_forged_shapes_is_rebuilt(tmp_path):
  data, _ = _data()
  MeanLogits.calls.clear()
  stats, _ = _get(tmp_path, data)
  path = _entry(tmp_path)
  for forged in (dict(stats, mean=stats["mean"][:3]), dict(stats, labels=stats["labels"].astype(np.float32)),
                 {k: v for k, v in stats.items() if k != "count"}):
    with open(path + ".json") as f:
      meta = json.load(f)
    np.savez(path + ".npz", **forged)  # a consistent forgery: the checksum updated too
    meta["sha256"] = files.sha256(path + ".npz")
    with open(path + ".json", "w") as f:
      json.dump(meta, f)
    lines, calls = [], len(MeanLogits.calls)
    again, _ = _get(tmp_path, data, log=lines.append)
    assert len(MeanLogits.calls) == calls + 1 and any("the method computes" in l or "missing" in l for l in lines)
    np.testing.assert_array_equal(again["mean"], stats["mean"])


@pytest.mark.parametrize("name", ["eata", "cfa", "foa"])
def test_declared_shapes_are_what_the_method_computes(name):
  from pcsr_jax import methods
  from pcsr_jax.methods.base import split

  method = methods.get(name)
  model, params = tiny.tiny_model()
  prep = method.prepare(model, params, jax.random.key(0), 4)
  frozen, trainable = split(prep.params, prep.is_trainable)
  x = np.random.default_rng(0).standard_normal((3, 32, 32, 3)).astype(np.float32)
  out = method.compute_source_stats(prep, frozen, trainable, iter([(x, np.arange(3, dtype=np.int32))]))
  declared = method.source_stats_shapes(prep, frozen, trainable)
  assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (s.shape, np.dtype(s.dtype))
                                                            for k, s in declared.items()}


def test_cfa_refuses_source_classes_that_are_not_the_heads(tmp_path):
  from pcsr_jax import methods

  data = _folder(tmp_path / "src", classes=3, per_class=1)()
  with pytest.raises(UserError, match=r"--source-data .*src \(for cfa\): data has 3 class folders but the "
                                      r"checkpoint's head has 1000 classes"):
    source_stats.check_labels(methods.get("cfa"), data, 1000)
  source_stats.check_labels(methods.get("eata"), data, 1000)  # EATA and FOA do not read the labels
  source_stats.check_labels(methods.get("cfa"), data, 3)
