"""CCC's calibration in the harness (`pcsr_jax.ccc_stream`): its cache held to the checks a fresh calibration
gets, a damaged or foreign entry rebuilt and one that cannot be written run without, unreadable calibration
images skipped and counted, the clean classes checked before any calibration work, and the plan's bounds.

Every test runs the real calibration (`ccc_stream.build`) on a tiny one: CCC's 0 % target (4 corruptions), a
few calibration images, a short walk. ``cfg.checkpoint`` only names where the cache goes, so each test points
it into its own folder and starts from an empty cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tracemalloc

import numpy as np
import pytest
from PIL import Image

import harness_fixtures as hf
from pcsr_jax import ccc_stream, checkpoint, engine, harness
from pcsr_jax.data import datasets, imagenet, transforms
from pcsr_jax.data.generators import ccc, generated
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import builtin

CALIBRATION_IMAGES = 4


class Model:
  """A checkpoint loaded for `ccc_stream.build`: model, params, meta, preprocessing and params digest."""

  def __init__(self, path: str, dataset: str):
    self.model, self.params, self.meta = checkpoint.load(path, kind="vit")
    self.preprocess = datasets.get(dataset).preprocess(self.meta)
    self.digest = checkpoint.params_digest(self.params)

  def build(self, cfg, lines: list):
    return ccc_stream.build(cfg, self.model, self.params, self.meta, self.preprocess, self.digest, lines.append)

  def predict(self, img) -> int:
    """The class the checkpoint gives a clean image as CCC's calibration shows it at ImageNet strength: the
    release's centre crop, the JPEG round trip, the checkpoint's resize and normalization."""
    x = np.asarray(generated.jpeg_round_trip(generated.release_crop(img)))
    x = self.preprocess.to_uint8(Image.fromarray(x))[None]
    table = transforms.normalize_table(self.meta["mean"], self.meta["std"])
    return int(np.asarray(self.model.apply({"params": self.params}, engine.normalize_uint8(x, table))).argmax())


@pytest.fixture(scope="module")
def fmnist():
  return Model(builtin.CHECKPOINT, "fmnist_c")


def builtin_cfg(tmp_path, **kw):
  """The built-in benchmark's CCC, its cache under ``tmp_path``."""
  return builtin.run_config(str(tmp_path / "out"), images=64, methods=("source",), setting="ccc",
                            checkpoint=str(tmp_path / "ckpt"), progress=False, ccc_target=0, ccc_length=64,
                            ccc_speed=32, ccc_calibration_images=CALIBRATION_IMAGES, batch_size=4, **kw)


def cache_path(tmp_path) -> str:
  """The one calibration entry in ``tmp_path``'s cache."""
  d = str(tmp_path / "ckpt.source_stats")
  found = [f for f in os.listdir(d) if f.startswith("ccc-calibration-")]
  assert len(found) == 1, found
  return os.path.join(d, found[0])


@pytest.fixture(scope="module")
def fresh(fmnist, tmp_path_factory):
  """A fresh calibration of the built-in model: ``(entry file name, its JSON, build's record)``."""
  tmp = tmp_path_factory.mktemp("fresh")
  lines = []
  _, record = fmnist.build(builtin_cfg(tmp), lines)
  assert any("not computed yet" in l for l in lines) and any("calibration saved to" in l for l in lines), lines
  path = cache_path(tmp)
  with open(path) as f:
    return os.path.basename(path), json.load(f), record


def plant(tmp_path, fresh, text: str) -> str:
  """Writes ``text`` where ``tmp_path``'s cache keeps the calibration ``fresh`` made; returns the path."""
  d = tmp_path / "ckpt.source_stats"
  d.mkdir()
  path = str(d / fresh[0])
  with open(path, "w") as f:
    f.write(text)
  return path


def edited(fresh, edit) -> str:
  """The fresh entry as JSON after ``edit(entry)`` (NaN written as JSON's NaN, None as null)."""
  data = json.loads(json.dumps(fresh[1]))
  edit(data)
  return json.dumps(data, indent=1)


def set_value(value, corruption="contrast", k=3):
  def edit(data):
    data["curves"][corruption][k] = value
  return edit


def zero_clean(data):
  for v in data["curves"].values():
    v[0] = 0.0
  data["clean_accuracy"] = 0.0


@pytest.mark.parametrize("edit,why", [
    (set_value(1e9), "accuracy 1000000000.0 at contrast 0.75 outside 0..100"),
    (set_value(-50), "accuracy -50 at contrast 0.75 outside 0..100"),
    (set_value(float("nan"), "shot_noise", 5), "accuracy nan at shot_noise 1.25 outside 0..100"),
    (set_value(None), "accuracy None at contrast 0.75 is not a number"),
    (zero_clean, "clean accuracy 0%"),
    (lambda data: data.update(images=99), "read counts images 99"),
    (lambda data: data["curves"].pop("contrast"), "no curve for contrast"),
])
def test_a_damaged_cache_entry_is_rebuilt_saying_why(fmnist, fresh, tmp_path, edit, why):
  """An entry edited to what no calibration gives (accuracies outside 0..100, NaN, null, a clean accuracy of 0,
  counts that do not add up, a missing curve) is refused by the check a fresh calibration gets, measured again
  with one log line naming the file and why, and replaced by the fresh result."""
  path = plant(tmp_path, fresh, edited(fresh, edit))
  lines = []
  _, record = fmnist.build(builtin_cfg(tmp_path), lines)
  calibrating = [l for l in lines if "ccc: calibrating" in l]
  assert len(calibrating) == 1 and f"({path}: {why}" in calibrating[0], lines
  assert record["calibration"] == fresh[2]["calibration"] and record["walk"] == fresh[2]["walk"]
  with open(path) as f:
    assert json.load(f) == fresh[1]


def test_the_cache_and_a_fresh_calibration_share_one_check(fresh):
  """The rule that rebuilds a cached entry is the one a fresh calibration raises on, with the same words."""
  curves = {c: list(v) for c, v in fresh[1]["curves"].items()}
  assert ccc.curves_problem(curves, ccc.NOISES[0]) == ""
  curves["contrast"][3] = 1e9
  why = ccc.curves_problem(curves, ccc.NOISES[0])
  assert why == "accuracy 1000000000.0 at contrast 0.75 outside 0..100 (a percentage is expected)"
  images = np.zeros((2, 32, 32, 3), np.uint8)
  with pytest.raises(ValueError) as e:
    ccc.calibrate(images, np.zeros(2), lambda x, y: 1e9 if x.mean() == 1 else 50.0,
                  lambda x, c, s: np.ones_like(x) if (c, s) == ("contrast", 0.75) else x, ccc.NOISES[0])
  assert str(e.value) == f"ccc calibration: {why}"


def test_unreadable_and_foreign_entries_are_rebuilt(fmnist, fresh, tmp_path):
  """Text that is not JSON and JSON that is not a calibration: rebuilt, saying which."""
  path = plant(tmp_path, fresh, "{not json")
  lines = []
  fmnist.build(builtin_cfg(tmp_path), lines)
  assert any(f"({path} unreadable (JSONDecodeError)" in l for l in lines), lines
  with open(path, "w") as f:
    json.dump([1, 2], f)
  lines = []
  fmnist.build(builtin_cfg(tmp_path), lines)
  assert any(f"({path} is not a calibration" in l for l in lines), lines
  with open(path) as f:
    assert json.load(f) == fresh[1]


def test_a_directory_in_place_of_the_entry_runs_uncached(fmnist, fresh, tmp_path):
  """A directory where the entry goes: the calibration is measured, the run goes on from it, and the log says it
  could not be cached (no ``IsADirectoryError``); the directory is left as it was."""
  d = tmp_path / "ckpt.source_stats" / fresh[0]
  d.mkdir(parents=True)
  (d / "keep").write_text("x")
  lines = []
  src, record = fmnist.build(builtin_cfg(tmp_path), lines)
  assert any(f"({d} is not a file;" in l for l in lines), lines
  assert any(f"ccc: calibration not cached: cannot write {d}" in l and "fresh calibration" in l for l in lines), lines
  assert record["calibration"] == fresh[2]["calibration"] and len(src) == 64
  assert (d / "keep").read_text() == "x" and os.listdir(d) == ["keep"]


def test_an_immutable_damaged_entry_runs_uncached(fmnist, fresh, tmp_path):
  """A damaged entry that cannot be replaced (``chattr +i``; no ``PermissionError``): rebuilt for this run,
  which says it was not cached."""
  path = plant(tmp_path, fresh, edited(fresh, set_value(1e9)))
  if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
    pytest.skip("chattr +i is not available here (needs root and a filesystem that has it)")
  try:
    lines = []
    _, record = fmnist.build(builtin_cfg(tmp_path), lines)
  finally:
    subprocess.run(["chattr", "-i", path], check=True)
  assert any(f"({path}: accuracy 1000000000.0" in l for l in lines), lines
  assert any(f"ccc: calibration not cached: cannot write {path} (Operation not permitted)" in l for l in lines), lines
  assert record["calibration"] == fresh[2]["calibration"]
  with open(path) as f:
    assert json.load(f)["curves"]["contrast"][3] == 1e9  # untouched
  assert os.listdir(os.path.dirname(path)) == [fresh[0]]  # no temporary file left


# ImageNet strength: a clean wnid folder and the tiny random 1000-class checkpoint, its images filed under the
# class the checkpoint predicts (a model right on every one) or the next class (wrong on every one).
@pytest.fixture(scope="module")
def folder_world(tmp_path_factory):
  root = tmp_path_factory.mktemp("ccc_folder")
  hf.make_checkpoint(str(root / "ckpt"))
  model = Model(str(root / "ckpt"), "imagenet_c")
  rng = np.random.default_rng(0)
  for k in range(12):
    yy, xx = np.mgrid[0:48, 0:56] / 56
    base = np.stack([np.sin(6 * xx + k), np.cos(5 * yy + k), np.sin(4 * (xx + yy))], -1)
    img = Image.fromarray(np.clip(127 + 90 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))
    c = model.predict(img)
    for folder, label in (("right", c), ("wrong", (c + 1) % 1000)):
      os.makedirs(root / folder / imagenet.wnids()[label], exist_ok=True)
      img.save(root / folder / imagenet.wnids()[label] / f"ILSVRC2012_val_{k:08d}.JPEG", quality=92)
  return root, model


def folder_cfg(tmp_path, clean_data, calibration_images=6):
  return harness.RunConfig(data=None, clean_data=str(clean_data), checkpoint=str(tmp_path / "ckpt"),
                           output=str(tmp_path / "out"), setting="ccc", ccc_target=0,
                           ccc_calibration_images=calibration_images, ccc_length=16, ccc_speed=8, batch_size=4,
                           progress=False)


def calibration_files(clean_data, n) -> list:
  """The files of the clean folder that CCC's calibration reads (`ccc.calibration_split`), in order."""
  files = sorted(os.path.join(w, f) for w in os.listdir(clean_data) for f in os.listdir(clean_data / w))
  calib, _ = ccc.calibration_split(len(files), n, ccc_stream.CALIBRATION_SEED)
  return [files[i] for i in calib]


def test_unreadable_calibration_images_are_skipped_and_counted(folder_world, tmp_path):
  """An unreadable file among the calibration images is left out as the stream leaves one out: the log and the
  record count and name it, the calibration of the rest is cached under the same key and read back with the
  same counts; with fewer than half readable the calibration refuses in one line naming them."""
  root, model = folder_world
  clean = tmp_path / "clean"
  shutil.copytree(root / "right", clean)
  bad = calibration_files(clean, 6)[2]
  (clean / bad).write_bytes(b"not an image")
  lines = []
  _, record = model.build(folder_cfg(tmp_path, clean), lines)
  cal = record["calibration"]
  assert (cal["images"], cal["skipped"], cal["skipped_names"]) == (5, 1, [bad])
  assert any(f"ccc: 1 of 6 calibration images could not be read and were left out (e.g. {bad})" in l
             for l in lines), lines
  assert cal["clean_accuracy"] == 100.0  # the five read, all right
  lines = []
  _, again = model.build(folder_cfg(tmp_path, clean), lines)
  assert again["calibration"] == cal
  assert any(l.startswith("ccc: calibration from") and f"1 of 6 calibration images unreadable, left out: {bad}" in l
             for l in lines), lines
  for name in calibration_files(clean, 6)[:4]:
    (clean / name).write_bytes(b"")
  with pytest.raises(UserError) as e:
    model.build(folder_cfg(tmp_path, clean), [])
  assert str(e.value).startswith(f"--clean-data {clean}: only 2 of the 6 CCC calibration images could be read "
                                 f"(at least 3 needed; unreadable: ")
  assert "\n" not in str(e.value)


def test_a_model_no_clean_image_finds_right_is_refused_in_one_line(folder_world, tmp_path):
  """A fresh calibration at a clean accuracy of 0: one line naming the checkpoint and the data, nothing cached."""
  root, model = folder_world
  cfg = folder_cfg(tmp_path, root / "wrong")
  with pytest.raises(UserError) as e:
    model.build(cfg, [])
  assert str(e.value) == (f"--checkpoint {cfg.checkpoint}: CCC calibration on 6 clean images of --clean-data "
                          f"{root / 'wrong'}: clean accuracy 0%: accuracies are percentages (0..100), and a model "
                          f"at 1% or less cannot hold a target")
  assert not [f for f in os.listdir(tmp_path / "ckpt.source_stats") if f.startswith("ccc-")]


def test_clean_classes_are_checked_before_calibrating(folder_world, fmnist, tmp_path):
  """ImageNet wnid folders (1000 classes) against the built-in model's 10-class head: refused in one line before
  any calibration work (no calibration logged, none cached)."""
  root, _ = folder_world
  lines = []
  with pytest.raises(UserError) as e:
    fmnist.build(folder_cfg(tmp_path, root / "right"), lines)
  assert str(e.value) == (f"--clean-data {root / 'right'}: data has ImageNet wnid folders (1000 classes) but the "
                          f"checkpoint's head has 10 classes")
  assert not lines
  assert not os.path.exists(tmp_path / "ckpt.source_stats") or not os.listdir(tmp_path / "ckpt.source_stats")


def _curves(noises, clean=80.0):
  return {c: clean * np.exp(-(0.2 + 0.1 * i) * ccc.GRID) for i, c in enumerate(noises)}


@pytest.mark.parametrize("kw,match", [
    (dict(length=10**12), "--ccc-length: expected an integer 1 to 75,000,000 (10 x CCC's run"),
    (dict(length=ccc.MAX_LENGTH + 1), "--ccc-length: expected an integer 1 to 75,000,000"),
    (dict(speed=10**12), "--ccc-speed: expected an integer 1 to 75,000,000 (images per walk step"),
    (dict(speed=0), "--ccc-speed: expected an integer 1 to"),
    (dict(length=2.5), "--ccc-length: expected an integer"),
])
def test_plan_refuses_a_length_or_speed_above_its_maximum(kw, match):
  """A length or speed of 1e12 asked for terabytes (``MemoryError``); above `ccc.MAX_LENGTH` / `ccc.MAX_SPEED`
  the plan refuses in one line."""
  args = dict(speed=10, length=100) | kw
  with pytest.raises(UserError, match=re.escape(match)) as e:
    ccc.make_plan(_curves(ccc.NOISES[0]), 80.0, 0, args["speed"], args["length"], np.arange(10, 300), 0)
  assert "\n" not in str(e.value)
  assert ccc.MAX_SPEED == ccc.MAX_LENGTH == 10 * ccc.LENGTH


def test_plan_memory_per_image_at_speed_one():
  """The bound `ccc.MAX_LENGTH` rests on: at speed 1 (a walk step per image, the most steps) the plan takes its
  4 bytes per image and 12 per step, not a Python object per step (measured: about 150 bytes per image)."""
  curves = _curves(ccc.NOISES[0])

  def peak(length):
    tracemalloc.start()
    ccc.make_plan(curves, 80.0, 0, 1, length, np.arange(10, 300), 0)
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top

  per_image = (peak(6000) - peak(2000)) / 4000
  assert per_image < 20, per_image
