"""uint8 input: the engine normalizes on the device, bit for bit as the host's `Preprocess.normalize` did."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from PIL import Image

import harness_fixtures as hf
from pcsr_jax import engine, harness, methods
from pcsr_jax.data import transforms
from pcsr_jax.errors import UserError
from tiny import TINY, tiny_model

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5,) * 3, (0.5,) * 3)


def uint8_batches(sizes, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (s, TINY.img_size, TINY.img_size, 3), dtype=np.uint8) for s in sizes]


@pytest.mark.parametrize("mean,std", [HALF, IMAGENET], ids=["half", "imagenet"])
def test_device_normalization_is_bit_identical_to_the_host(mean, std):
  pre = transforms.Preprocess(32, mean, std, "none")
  x = uint8_batches([4])[0]
  x[0] = (np.arange(x[0].size) % 256).reshape(x[0].shape)  # every uint8 value in every channel (3 and 256 coprime)
  host = np.stack([pre(img) for img in x])  # today's float path: `Preprocess.normalize` per image
  table = transforms.normalize_table(mean, std)
  dev = np.asarray(jax.jit(lambda a: engine.normalize_uint8(a, table))(x))
  assert dev.dtype == np.float32 and host.dtype == np.float32
  np.testing.assert_array_equal(dev, host)
  # Padded rows become 0, as the float path pads.
  valid = np.array([True, True, False, False])
  dev = np.asarray(jax.jit(lambda a, v: engine.normalize_uint8(a, table, v))(x, valid))
  np.testing.assert_array_equal(dev[:2], host[:2])
  assert not dev[2:].any()
  # `Preprocess.__call__` = `normalize(to_uint8(...))` on a PIL image.
  img = Image.fromarray(uint8_batches([1], seed=3)[0][0]).resize((40, 48))
  pre = transforms.Preprocess(32, mean, std, "bicubic", crop_pct=0.9)
  assert pre.to_uint8(img).dtype == np.uint8 and pre.to_uint8(img).shape == (32, 32, 3)
  np.testing.assert_array_equal(pre(img), pre.normalize(pre.to_uint8(img)))


@pytest.mark.parametrize("name", ["source", "tent", "sar", "pcsr"])
def test_uint8_step_equals_the_host_normalized_step(name):
  """Same logits, metrics and updated state, bit for bit, over a stream ending in a padded (ragged) batch."""
  model, params = tiny_model()
  mean, std = IMAGENET
  pre = transforms.Preprocess(TINY.img_size, mean, std, "none")
  kw = dict(margin_factor=2.0) if name == "pcsr" else {}
  u8 = engine.Adapter(methods.get(name, **kw), model, params, batch_size=6, mean=mean, std=std)
  f32 = engine.Adapter(methods.get(name, **kw), model, params, batch_size=6)
  s8, s32 = u8.init_state(), f32.init_state()
  for x in uint8_batches([6, 6, 4]):
    s8, l8, m8 = u8.step(s8, x)
    s32, l32, m32 = f32.step(s32, pre.normalize(x))
    np.testing.assert_array_equal(np.asarray(l8)[:len(x)], np.asarray(l32)[:len(x)])
    for k in m32:
      np.testing.assert_array_equal(np.asarray(m8[k]), np.asarray(m32[k]), err_msg=k)
  leaves8, leaves32 = jax.tree.leaves(u8.state_to_host(s8)), jax.tree.leaves(f32.state_to_host(s32))
  assert len(leaves8) == len(leaves32)
  for a, b in zip(leaves8, leaves32):
    np.testing.assert_array_equal(a, b)
  if name != "source":
    assert int(s8.step) == 3
    assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(u8.state_to_host(u8.init_state()).trainable),
                                                       jax.tree.leaves(u8.state_to_host(s8).trainable)))


def test_input_dtype_checks():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("source"), model, params, batch_size=2)
  with pytest.raises(UserError, match="uint8 images"):
    ad.step(ad.init_state(), uint8_batches([2])[0])
  with pytest.raises(UserError, match="both mean and std"):
    engine.Adapter(methods.get("source"), model, params, batch_size=2, mean=(0.5,) * 3)
  ad = engine.Adapter(methods.get("source"), model, params, batch_size=2, mean=(0.5,) * 3, std=(0.5,) * 3)
  _, logits, _ = ad.step(ad.init_state(), np.zeros((2, 32, 32, 3), np.float64))  # float64: taken as normalized
  assert ad.place(uint8_batches([1])[0])[0].dtype == np.uint8  # 4x fewer bytes to the device
  pre = transforms.Preprocess(32, (0.5,) * 3, (0.5,) * 3, "none")
  with pytest.raises(ValueError, match="dtype float32"):
    pre.to_uint8(np.zeros((32, 32, 3), np.float32))


def test_harness_results_equal_the_host_float_path(tmp_path, monkeypatch):
  """The harness (uint8 loader, device normalization) gives the records and predictions of the float path,
  run by handing the engine `Preprocess.__call__`'s host-normalized float32 instead."""
  world = hf.make_world(tmp_path / "world", ("fog",), classes=4, per_class=5)

  def run(out):
    cfg = harness.RunConfig(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out),
                            corruptions=("fog",), seeds=(1,), batch_size=8, progress=False,
                            methods=("source", "tent"), save_predictions=True)
    return harness.run(cfg, log=lambda *a: None)

  got = run(tmp_path / "u8")
  to_uint8 = transforms.Preprocess.to_uint8
  with monkeypatch.context() as m:  # the loader then hands host-normalized float32, as before uint8 input
    m.setattr(transforms.Preprocess, "to_uint8", lambda self, img: self.normalize(to_uint8(self, img)))
    want = run(tmp_path / "f32")
  drop = ("seconds", "images_per_s", "output")
  strip = lambda recs: [{k: v for k, v in r.items() if k not in drop} for r in recs]
  assert strip(got["records"]) == strip(want["records"]) and len(got["records"]) == 2
  for f in ("source_fog_5_seed1.npz", "tent_fog_5_seed1.npz"):
    a, b = np.load(tmp_path / "u8" / "predictions" / f), np.load(tmp_path / "f32" / "predictions" / f)
    for k in b.files:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"{f}:{k}")
  assert json.loads((tmp_path / "u8" / "results.json").read_text())["complete"]
  assert got["records"][1]["num_samples"] == 20  # 8 + 8 + a padded 4
