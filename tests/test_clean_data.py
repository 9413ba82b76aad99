"""`--clean-data`: ImageNet-C generated in the stream, end to end through the harness.

The generator itself (the release's crop, the corruptions, the JPEG round trip) is tested in
test_generated.py; here: the harness reads a generated stream exactly as it reads the release-way folder, the
worker processes see the same pixels as the threads, and the flags fail in one line.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

import harness_fixtures as hf
from pcsr_jax import checkpoint, harness
from pcsr_jax.data import imagenet, sources, transforms
from pcsr_jax.data.generators import ccc, generated
from pcsr_jax.data.loader import Loader
from pcsr_jax.errors import UserError
from pcsr_jax.experiments.imagenet_c import main

SIZES = ((300, 260), (260, 300), (256, 333), (231, 240))  # (width, height): both orientations, odd crops


def make_clean(root: str, classes: int = 3, per_class: int = 4, seed: int = 0) -> list[str]:
  """``<root>/<wnid>/*.JPEG``: smooth images with texture (so blurs and pixelation change them), odd sizes."""
  rng = np.random.default_rng(seed)
  wnids = list(imagenet.wnids()[:: 1000 // classes][:classes])
  for ci, w in enumerate(wnids):
    os.makedirs(os.path.join(root, w), exist_ok=True)
    for k in range(per_class):
      wd, ht = SIZES[(ci + k) % len(SIZES)]
      yy, xx = np.mgrid[0:ht, 0:wd] / max(wd, ht)
      base = np.stack([np.sin(6 * xx + ci), np.cos(5 * yy + k), np.sin(4 * (xx + yy))], -1)
      img = np.clip(127 + 90 * base + rng.normal(0, 12, (ht, wd, 3)), 0, 255).astype(np.uint8)
      Image.fromarray(img).save(os.path.join(root, w, f"ILSVRC2012_val_{ci * per_class + k:08d}.JPEG"),
                                quality=92)
  return wnids


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("clean_world")
  make_clean(str(root / "clean"))
  hf.make_checkpoint(str(root / "ckpt"))
  return root


def cfg(world, out, **kw):
  base = dict(data=None, clean_data=str(world / "clean"), checkpoint=str(world / "ckpt"), output=str(out),
              corruptions=("contrast", "pixelate"), severity=5, seeds=(1,), batch_size=4, progress=False,
              methods=("source", "tent"), save_predictions=True)
  base.update(kw)
  return harness.RunConfig(**base)


def predictions(out) -> dict:
  d = os.path.join(str(out), "predictions")
  return {f: dict(np.load(os.path.join(d, f))) for f in sorted(os.listdir(d))}


@pytest.mark.torch
def test_stream_equals_the_release_way_folder(world, tmp_path):
  """The deterministic corruptions: the harness over `--clean-data` gives the same records and per-image
  predictions, TENT's adaptation included, as over a folder written by the reference of the release's
  make_imagenet_c.py (torchvision's Resize + CenterCrop, PIL's JPEG quality 85 on disk)."""
  from benchmarks.torch_methods import make_imagenet_c as release

  corr = ("contrast", "pixelate", "zoom_blur")
  release.write_release_folder(str(world / "clean"), str(tmp_path / "release"), corr, 5)
  quiet = lambda *a, **k: None
  a = harness.run(cfg(world, tmp_path / "stream", corruptions=corr), log=quiet)
  b = harness.run(cfg(world, tmp_path / "folder", corruptions=corr, clean_data=None, data=str(tmp_path / "release")),
                  log=quiet)
  strip = lambda recs: [{k: v for k, v in r.items() if k not in ("seconds",)} for r in recs]
  assert strip(a["records"]) == strip(b["records"]) and len(a["records"]) == 6
  pa, pb = predictions(tmp_path / "stream"), predictions(tmp_path / "folder")
  assert list(pa) == list(pb) and len(pa) == 6
  for f in pa:
    for k in ("file_names", "labels", "predictions"):
      np.testing.assert_array_equal(pa[f][k], pb[f][k], err_msg=f"{f} {k}")


def test_worker_processes_generate_the_same_pixels(world):
  """Random corruptions are keyed per image: decoding in spawned worker processes (each its own numpy RNG)
  gives the threads' pixels, batch for batch, whatever the order."""
  meta = checkpoint.load_meta(str(world / "ckpt"), kind="vit")
  pre = transforms.imagenet_c_preprocess(meta)
  clean = sources.FolderSource(str(world / "clean"))
  srcs = [generated.CorruptedSource(clean, c, 3, seed=7) for c in ("gaussian_noise", "frost")]
  ids = np.repeat([0, 1], len(clean)).astype(np.int32)
  idx = np.tile(np.arange(len(clean)), 2)
  perm = np.random.default_rng(0).permutation(len(idx))

  def images(processes, order):
    loader = Loader(srcs, pre.to_uint8, batch_size=5, workers=2, processes=processes)
    try:
      got = [b for b in loader.batches(ids[order], idx[order])]
    finally:
      loader.close()
    names = [f"{t}/{n}" for b in got for t, n in zip(b.tags, b.names)]
    return dict(zip(names, np.concatenate([b.images for b in got])))

  threads = images(False, np.arange(len(idx)))
  procs = images(True, perm)
  assert len(threads) == len(idx) and set(threads) == set(procs)
  for k in threads:
    np.testing.assert_array_equal(threads[k], procs[k], err_msg=k)
  # Another corruption seed draws other noise.
  other = generated.CorruptedSource(clean, "gaussian_noise", 3, seed=8)
  assert not np.array_equal(np.asarray(other.load(0)), np.asarray(srcs[0].load(0)))


def run_cli(world, out, *flags):
  return main(["--checkpoint", str(world / "ckpt"), "--output", str(out), "--seeds", "1", "--batch-size", "4",
               "--no-progress", "--methods", "source", *flags])


@pytest.mark.parametrize("match,flags", [
    ("--clean-data /nowhere: not a folder", ["--clean-data", "/nowhere"]),
    ("--clean-data tfds:a:b:c: expected tfds", ["--clean-data", "tfds:a:b:c"]),
    (r"--data and --clean-data: give one", ["--clean-data", "CLEAN", "--data", "CLEAN"]),
    ("--clean-data generates ImageNet-C: not for --dataset imagenet_r",
     ["--clean-data", "CLEAN", "--dataset", "imagenet_r"]),
    (r"--severity: expected a number in \[0.01, 5\], got 5.5", ["--clean-data", "CLEAN", "--severity", "5.5"]),
    (r"--severity: expected a number in \[0.01, 5\], got 1e-10", ["--clean-data", "CLEAN", "--severity", "1e-10"]),
    ("--severity: expected a number, got 'high'", ["--clean-data", "CLEAN", "--severity", "high"]),
    (r"--severity: expected 1 to 5 \(fractions need generated data", ["--data", "CLEAN", "--severity", "2.5"]),
    ("--corruptions: unknown corruption 'rain'", ["--clean-data", "CLEAN", "--corruptions", "rain"]),
])
def test_bad_flags_fail_in_one_line(world, tmp_path, match, flags):
  flags = [str(world / "clean") if f == "CLEAN" else f for f in flags]
  with pytest.raises(UserError, match=match) as e:
    run_cli(world, tmp_path / "out", *flags)
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "out" / "results.json")


def test_fractional_severity_runs_and_is_recorded(world, tmp_path):
  """A fraction is a severity of its own (the tables interpolated): it runs, and the records say 2.5."""
  res = harness.run(cfg(world, tmp_path, corruptions=("brightness",), severity=2.5, methods=("source",)),
                    log=lambda *a, **k: None)
  assert [r["severity"] for r in res["records"]] == [2.5] and res["records"][0]["num_samples"] == 12
  assert os.path.exists(tmp_path / "predictions" / "source_brightness_2.5_seed1.npz")


def _relabelled_by_the_model(world, root) -> str:
  """The clean world's images filed under the class the checkpoint predicts for each (as the harness crops
  it): a random model that is right on every clean image, so that CCC has an accuracy to walk down from."""
  import shutil

  model, params, meta = checkpoint.load(str(world / "ckpt"), kind="vit")
  pre = transforms.imagenet_c_preprocess(meta)
  clean = sources.FolderSource(str(world / "clean"))
  for i, path in enumerate(clean.paths):
    x = pre(Image.fromarray(generated.release_crop(clean.load(i))))[None]
    c = int(np.asarray(model.apply({"params": params}, x)).argmax())
    os.makedirs(os.path.join(root, imagenet.wnids()[c]), exist_ok=True)
    shutil.copy(path, os.path.join(root, imagenet.wnids()[c], os.path.basename(path)))
  return root


@pytest.mark.parametrize("setting", ["continual", "mix_shifts", "label_shifts", "bs1", "gradual", "ccc"])
def test_every_setting_streams_generated_data(world, tmp_path, setting):
  """--clean-data through every setting (normal: the tests above): records for every domain, nothing read
  from disk but the clean images. CCC at its 0 % target (4 noise corruptions: a cheap calibration)."""
  kw = dict(corruptions=("gaussian_noise", "frost"), methods=("tent",), setting=setting, limit=8,
            save_predictions=False)
  if setting == "ccc":
    kw.update(ccc_target=0, ccc_calibration_images=4, ccc_length=16, ccc_speed=8,
              clean_data=_relabelled_by_the_model(world, str(tmp_path / "clean")))
  res = harness.run(cfg(world, tmp_path / "out", **kw), log=lambda *a, **k: None)
  recs = res["records"]
  if setting == "ccc":
    assert [(r["corruption"], r["num_samples"]) for r in recs] == [("ccc", 8)]  # --limit caps the walk
    with open(tmp_path / "out" / "results.json") as f:
      saved = json.load(f)["ccc"]
    assert [w["start"] for w in saved["walk"]] == [0, 8] and saved["calibration"]["clean_accuracy"] == 100
    assert set(saved["walk"][0]["pair"]) <= set(ccc.noises_for(0))
  elif setting == "gradual":
    assert len(recs) == 18 and {r["severity"] for r in recs} == {1, 2, 3, 4, 5}
    assert all(r["num_samples"] == 8 for r in recs)
  else:
    assert [r["corruption"] for r in recs] == ["gaussian_noise", "frost"]
    counts = [r["num_samples"] for r in recs]
    assert (sum(counts) == 8) if setting == "mix_shifts" else counts == [8, 8], recs  # --limit per segment


def test_device_path_equals_the_host_path_where_exact(world, tmp_path):
  """--corrupt-on device (here on the CPU backend): for the corruptions the device computes bit for bit
  (contrast, pixelate, JPEG compression, and the quality-85 round trip of every image) the harness's records
  and per-image predictions, TENT's adaptation included, equal the host path's."""
  corr = ("contrast", "pixelate", "jpeg_compression")
  quiet = lambda *a, **k: None
  a = harness.run(cfg(world, tmp_path / "host", corruptions=corr, corrupt_on="host"), log=quiet)
  b = harness.run(cfg(world, tmp_path / "device", corruptions=corr, corrupt_on="device"), log=quiet)
  strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]
  assert strip(a["records"]) == strip(b["records"]) and len(a["records"]) == 6
  pa, pb = predictions(tmp_path / "host"), predictions(tmp_path / "device")
  assert list(pa) == list(pb)
  for f in pa:
    np.testing.assert_array_equal(pa[f]["predictions"], pb[f]["predictions"], err_msg=f)
    np.testing.assert_array_equal(pa[f]["file_names"], pb[f]["file_names"], err_msg=f)


def test_device_path_draws_per_image(world, tmp_path):
  """Random corruptions on the device: each image's draws come from its own key, so Source's prediction of an
  image does not depend on the batch it came in or the order of the stream."""
  quiet = lambda *a, **k: None
  runs = []
  for bs, seed in ((4, 1), (6, 2)):
    out = tmp_path / f"bs{bs}"
    harness.run(cfg(world, out, corruptions=("gaussian_noise",), severity=5, corrupt_on="device", batch_size=bs,
                    seeds=(seed,), methods=("source",)), log=quiet)
    (f, p), = predictions(out).items()
    runs.append(dict(zip(p["file_names"].tolist(), p["predictions"].tolist())))
  assert runs[0] == runs[1] and len(runs[0]) == 12


@pytest.mark.parametrize("match,kw", [
    ("--corrupt-on device: glass_blur has no device version", dict(corruptions=("glass_blur",))),
    ("--corrupt-on device: --setting mix_shifts mixes corruptions", dict(setting="mix_shifts")),
    ("--corrupt-on device: the device path corrupts --clean-data's images", dict(clean_data=None, data="DATA")),
    ("--corrupt-on: expected auto, host or device", dict(corrupt_on="gpu")),
])
def test_device_path_refusals(world, tmp_path, match, kw):
  kw = {"corrupt_on": "device", **kw}
  if kw.get("data") == "DATA":
    kw["data"] = str(world / "clean")
  with pytest.raises(UserError, match=match):
    harness.run(cfg(world, tmp_path, **kw), log=lambda *a, **k: None)


@pytest.mark.slow
def test_killed_and_resumed_generated_stream_is_bit_identical(world, tmp_path):
  """Random corruptions generated in the stream, the run killed mid-stream (SIGKILL) and resumed: the records
  and per-image predictions of an uninterrupted run, bit for bit (each image regenerates from its own key)."""
  import subprocess
  import sys
  import time

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = [sys.executable, os.path.join(root, "experiments", "imagenet_c.py"), "--clean-data", str(world / "clean"),
          "--checkpoint", str(world / "ckpt"), "--corruptions", "gaussian_noise,frost", "--methods", "tent",
          "--seeds", "1", "--batch-size", "2", "--checkpoint-every", "1", "--save-predictions", "--no-progress"]
  full = subprocess.run([*args, "--output", str(tmp_path / "full")], capture_output=True, text=True, timeout=600)
  assert full.returncode == 0, full.stderr
  out = tmp_path / "killed"
  p = subprocess.Popen([*args, "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline:  # kill in the middle of the second corruption (its own unit)
    if any(u["key"].endswith("/frost") and u["batch"] >= 2 for u in hf.open_units(out)):
      break
    time.sleep(0.02)
  else:
    pytest.fail("the run never reached the kill point")
  p.kill()
  p.wait()
  resumed = subprocess.run([*args, "--output", str(out), "--resume"], capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
  strip = lambda d: [{k: v for k, v in r.items() if k != "seconds"} for r in d["records"]]
  assert strip(json.loads((out / "results.json").read_text())) == \
      strip(json.loads((tmp_path / "full" / "results.json").read_text()))
  a, b = predictions(tmp_path / "full"), predictions(out)
  assert list(a) == list(b) and len(a) == 2
  for f in a:
    for k in ("file_names", "labels", "predictions"):
      np.testing.assert_array_equal(a[f][k], b[f][k], err_msg=f"{f}:{k}")
