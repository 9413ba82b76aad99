"""CCC's continuously changing corruptions (`pcsr_jax.data.generators.ccc`): the walk search against CCC's recursive
code, the plan's rules and determinism, position-wise regeneration, and the calibration."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from PIL import Image

from benchmarks.torch_methods import ccc_walk
from pcsr_jax.data.generators import ccc, corruptions, generated
from pcsr_jax.data.generators.fmnist_c import ArraySource
from pcsr_jax.errors import UserError

def _curves(noises, clean=80.0, seed=0):
  """Monotone accuracy curves over the grid, from ``clean`` down, one steepness per corruption."""
  rng = np.random.default_rng(seed)
  return {c: clean * np.exp(-rng.uniform(0.1, 1.2) * ccc.GRID) for c in noises}


def _source(n=40, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  return ArraySource(images, rng.integers(0, 10, n), 10)


def _hand_plan(image, pairs, speed, seed=3, noises=("gaussian_noise", "contrast", "pixelate")):
  """A plan written by hand: ``pairs`` = [(c1, s1 index, c2, s2 index)] per step."""
  c1, s1, c2, s2 = (np.asarray(v, np.int8) for v in zip(*pairs))
  image = np.asarray(image, np.int32)
  return ccc.Plan(seed=seed, target=20.0, speed=speed, length=len(image), noises=noises, grid=ccc.GRID,
                  c1=c1, c2=c2, s1=s1, s2=s2, start=np.arange(len(pairs), dtype=np.int64) * speed, image=image)


@pytest.mark.parametrize("target", [0, 20, 40, 55])
def test_find_path_equals_ccc_recursion_on_random_matrices(target):
  rng = np.random.default_rng(target)
  for trial in range(12):
    n, m = (21, 21) if trial < 8 else tuple(rng.integers(2, 9, 2))
    acc = rng.uniform(0, 80, (n, m))
    if trial % 2:  # sorted like real accuracies: lower for stronger corruptions
      acc = np.sort(np.sort(acc, axis=0)[::-1], axis=1)[:, ::-1]
    assert ccc.find_path(acc, target) == ccc_walk.find_path(acc, target)


@pytest.mark.parametrize("target", [0, 20, 40])
def test_find_path_equals_ccc_recursion_on_ties(target):
  """Coarse values make equal path means frequent: both tie rules (move and start) are exercised."""
  rng = np.random.default_rng(100 + target)
  for _ in range(30):
    acc = rng.choice([0.0, 20.0, 40.0, 60.0], (21, 21))
    assert ccc.find_path(acc, target) == ccc_walk.find_path(acc, target)
  flat = np.full((21, 21), float(target))  # every move and every start ties
  assert ccc.find_path(flat, target) == ccc_walk.find_path(flat, target)
  assert ccc.find_path(flat, target)[0] == (1, 0)  # the first start wins a tie ...
  assert ccc.find_path(flat, target)[1] == (1, 1)  # ... and a move tie goes right


def test_find_path_shape_of_a_walk():
  acc = np.outer(70 * np.exp(-0.5 * ccc.GRID), 70 * np.exp(-0.3 * ccc.GRID)) / 70
  path = ccc.find_path(acc, 20)
  assert path[0][1] == 0 and path[0][0] >= 1 and path[-1][0] == 0
  for (i, j), (k, l) in zip(path, path[1:]):
    assert (k, l) in ((i - 1, j), (i, j + 1))
  assert abs(np.mean([acc[i, j] for i, j in path]) - 20) < 5
  with pytest.raises(ValueError, match="non-finite"):
    ccc.find_path(np.full((3, 3), np.nan), 20)


def test_noise_lists_are_ccc_lists_in_our_names():
  assert len(ccc.NOISES[40]) == 14 and "jpeg_compression" in ccc.NOISES[40]
  assert "jpeg_compression" not in ccc.NOISES[20] and len(ccc.NOISES[20]) == 13
  assert ccc.NOISES[0] == ("gaussian_noise", "shot_noise", "impulse_noise", "contrast")
  assert all(c in corruptions.ALL for t in ccc.NOISES for c in ccc.NOISES[t])
  assert "brightness" not in ccc.NOISES[40]
  assert ccc.noises_for(30) == ccc.NOISES[20] and ccc.noises_for(10) == ccc.NOISES[0]
  assert len(ccc.GRID) == 21 and ccc.GRID[1] == 0.25 and ccc.GRID[-1] == 5


def test_plan_follows_the_walk_rules_and_is_deterministic():
  noises = ccc.NOISES[20]
  curves = _curves(noises)
  pool = np.arange(100, 400)  # 0..99: the calibration subset, never shown
  plan = ccc.make_plan(curves, 80.0, 20, speed=50, length=6_025, pool=pool, seed=7)
  again = ccc.make_plan(curves, 80.0, 20, speed=50, length=6_025, pool=pool, seed=7)
  assert plan.digest() == again.digest() and plan.walk() == again.walk()
  assert ccc.make_plan(curves, 80.0, 20, speed=50, length=6_025, pool=pool, seed=8).digest() != plan.digest()
  assert len(plan.image) == 6_025 and plan.image.dtype == np.int32
  assert np.isin(plan.image, pool).all()
  # Positions per step = speed (the last one cut by the length); no image twice within a step.
  assert (np.diff(plan.start) == 50).all() and plan.start[0] == 0 and len(plan.start) == 121
  for t in range(120):
    assert len(np.unique(plan.image[t * 50:(t + 1) * 50])) == 50
  # The steps are the walks of find_path, one after another; each walk's second corruption is the next's first.
  steps = plan.walk()
  t, walks = 0, []
  while t < len(steps):
    a, b = steps[t]["pair"]
    path = ccc.find_path(ccc.pair_matrix(curves, a, b, 80.0), 20)
    got = [(round(s["s1"] * 4), round(s["s2"] * 4)) for s in steps[t:t + len(path)]]
    assert got == path[:len(got)] and all(s["pair"] == [a, b] for s in steps[t:t + len(path)])
    walks.append((a, b))
    t += len(path)
  assert len(walks) > 3 and all(a != b for a, b in walks)
  assert all(w[1] == nxt[0] for w, nxt in zip(walks, walks[1:]))
  assert plan.at(120) == (steps[2]["pair"][0], steps[2]["s1"], steps[2]["pair"][1], steps[2]["s2"])
  # A shorter plan is a prefix of a longer one.
  short = ccc.make_plan(curves, 80.0, 20, speed=50, length=1_010, pool=pool, seed=7)
  assert np.array_equal(short.image, plan.image[:1_010]) and short.walk() == steps[:21]


def test_plan_stays_small_and_small_pools_repeat():
  curves = _curves(ccc.NOISES[0], clean=60.0)
  plan = ccc.make_plan(curves, 60.0, 0, speed=1000, length=200_000, pool=np.arange(5, 300), seed=1)
  arrays = [plan.image, plan.c1, plan.c2, plan.s1, plan.s2, plan.start]
  assert sum(a.nbytes for a in arrays) < 4.1 * 200_000  # int32 per position, a few bytes per step
  step = plan.image[:1000]  # speed > pool: whole shuffles of the pool, one after another
  assert sorted(step[:295]) == list(range(5, 300))
  assert plan.image.min() >= 5


def test_plan_bad_input():
  curves = _curves(ccc.NOISES[0])
  with pytest.raises(UserError, match="percentages"):
    ccc.make_plan(curves, 0.8, 0, 10, 100, np.arange(10), 0)
  with pytest.raises(UserError, match="no curve for .*contrast"):
    ccc.make_plan({c: v for c, v in curves.items() if c != "contrast"}, 80.0, 0, 10, 100, np.arange(10), 0)
  with pytest.raises(UserError, match="pool"):
    ccc.make_plan(curves, 80.0, 0, 10, 100, [], 0)
  with pytest.raises(UserError, match="calibration images"):
    ccc.calibration_split(10, 10, 0)


def test_calibration_split_is_disjoint_and_seeded():
  calib, pool = ccc.calibration_split(1000, 100, 4)
  assert len(calib) == 100 and len(pool) == 900 and not np.intersect1d(calib, pool).size
  assert np.array_equal(calib, ccc.calibration_split(1000, 100, 4)[0])
  assert not np.array_equal(calib, ccc.calibration_split(1000, 100, 5)[0])


def test_calibrate_measures_each_corruption_alone():
  src = _source(24)
  labels = src.labels
  calls = []

  def corrupt_fn(x, c, s):  # integer severities only until corruptions.py takes fractions
    calls.append((c, s))
    return np.stack([corruptions.corrupt(img, c, int(np.ceil(s)), 0, i) for i, img in enumerate(x)])

  def accuracy_fn(x, y):  # a "model" that is right on images that stayed bright
    return 100.0 * float(np.mean((x.reshape(len(x), -1).mean(1) > 127) == (y % 2 == 0)))

  grid = np.array([0.0, 1, 3, 5])
  curves = ccc.calibrate(src.images, labels, accuracy_fn, corrupt_fn, ("contrast", "gaussian_noise"), grid)
  assert set(curves) == {"contrast", "gaussian_noise"}
  assert calls == [(c, s) for c in ("contrast", "gaussian_noise") for s in (1.0, 3.0, 5.0)]
  clean = accuracy_fn(src.images, labels)
  assert curves["contrast"][0] == curves["gaussian_noise"][0] == clean
  assert curves["contrast"][3] == accuracy_fn(corrupt_fn(src.images, "contrast", 5), labels)
  assert ccc.pair_matrix(curves, "contrast", "gaussian_noise", clean)[0].tolist() == \
      pytest.approx(curves["gaussian_noise"].tolist())
  with pytest.raises(ValueError, match="percentage"):
    ccc.calibrate(src.images, labels, lambda x, y: 1.5 * 100, corrupt_fn, ("contrast",), grid)


def test_source_regenerates_each_position_alone_at_cifar_strength():
  src = _source(40)
  # Steps: gaussian noise 2 + contrast 0; contrast 3 + pixelate 1; clean (s1 = s2 = 0).
  plan = _hand_plan(np.arange(12) % 40 + 3, [(0, 8, 1, 0), (1, 12, 2, 4), (0, 0, 1, 0)], speed=4)
  stream = ccc.CCCSource(src, plan)
  assert len(stream) == 12 and stream.labels.tolist() == src.labels[plan.image].tolist()
  assert stream.names[5] == "ccc00000005/test_00008" and len(stream.names) == 12
  assert not isinstance(stream.names, list)
  k = 5  # alone, in any order, in another process's copy: the same pixels
  first = stream.load(k)
  for j in (11, 0, 7):
    stream.load(j)
  assert np.array_equal(first, stream.load(k))
  assert np.array_equal(first, pickle.loads(pickle.dumps(stream)).load(k))
  # What it is: contrast 3 on the clean image, then pixelate 1 (np.uint8 in between), seeded by (seed, k).
  want = corruptions.corrupt(corruptions.corrupt(src.images[8], "contrast", 3, 3, k), "pixelate", 1, 3, k)
  assert first.dtype == np.uint8 and np.array_equal(first, want)
  noisy = corruptions.corrupt(src.images[plan.image[1]], "gaussian_noise", 2, 3, 1)
  assert np.array_equal(stream.load(1), noisy)  # s2 = 0: corruption 2 not applied
  assert np.array_equal(stream.load(9), src.images[plan.image[9]])  # s1 = s2 = 0: the clean image
  assert stream.describe.startswith("ccc v1 target 20 speed 4 seed 3 length 12 strength cifar")
  other = ccc.CCCSource(src, _hand_plan(plan.image, [(0, 8, 1, 0), (1, 12, 2, 8), (0, 0, 1, 0)], speed=4))
  assert other.describe != stream.describe


@pytest.mark.torch
def test_random_resized_crop_fallback_and_crop_equal_torchvision():
  import torch
  import torchvision.transforms.functional as tvf
  from torchvision import transforms as tvt

  rng = np.random.default_rng(0)
  # Too thin for any of the 10 tries: both fall back to the same centre crop.
  thin = Image.fromarray(rng.integers(0, 256, (300, 9, 3), dtype=np.uint8))
  torch.manual_seed(0)
  want = tvt.RandomResizedCrop(224)(thin)
  assert np.array_equal(np.asarray(ccc.random_resized_crop(thin, rng)), np.asarray(want))
  img = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
  for _ in range(5):
    top, left, h, w = int(rng.integers(0, 30)), int(rng.integers(0, 40)), int(rng.integers(20, 60)), \
        int(rng.integers(20, 80))
    want = tvf.resized_crop(img, top, left, h, w, [224, 224])
    got = img.crop((left, top, left + w, top + h)).resize((224, 224), Image.BILINEAR)
    assert np.array_equal(np.asarray(got), np.asarray(want))
  # The sampled crops: inside the image, areas in the scale range, aspect ratios in the ratio range.
  for _ in range(200):
    top, left, h, w = ccc.crop_params(120, 90, rng)
    assert 0 <= top <= 90 - h and 0 <= left <= 120 - w
    assert 0.07 < h * w / (120 * 90) < 1.01 and 0.7 < w / h < 1.4
  assert ccc.random_resized_crop(img, rng).size == (224, 224)


def test_imagenet_strength_crop_and_jpeg_without_corruption():
  """Severity 0 on both: flip + RandomResizedCrop(224) + the JPEG q85 round trip, keyed by (seed, k)."""
  rng = np.random.default_rng(1)
  pil = [Image.fromarray(rng.integers(0, 256, (60 + 7 * i, 80, 3), dtype=np.uint8)) for i in range(3)]

  class PILSource:
    labels, names, num_label_classes, imagenet_labels = np.arange(3), ["a", "b", "c"], 1000, True

    def __len__(self):
      return 3

    def load(self, i):
      return pil[i]

  plan = _hand_plan([0, 1, 2, 2], [(0, 0, 1, 0)], speed=4)
  stream = ccc.CCCSource(PILSource(), plan, strength="imagenet")
  out = stream.load(3)
  assert isinstance(out, Image.Image) and out.size == (224, 224) and out.mode == "RGB"
  assert np.array_equal(np.asarray(out), np.asarray(stream.load(3)))
  assert not np.array_equal(np.asarray(out), np.asarray(stream.load(2)))  # same image, another crop
  crop_rng = np.random.default_rng([plan.seed, 3, ccc._CROP_KEY])
  x = pil[2].transpose(Image.FLIP_LEFT_RIGHT) if crop_rng.random() < 0.5 else pil[2]
  want = generated.jpeg_round_trip(np.asarray(ccc.random_resized_crop(x, crop_rng)))
  assert np.array_equal(np.asarray(out), np.asarray(want))


def test_fractional_severities_at_both_strengths():
  """A walk with quarter steps runs at both strengths."""
  src = _source(8)
  plan = _hand_plan(np.arange(8), [(0, 9, 1, 3), (1, 5, 2, 11)], speed=4)
  stream = ccc.CCCSource(src, plan)
  x = stream.load(6)
  want = corruptions.corrupt(corruptions.corrupt(src.images[6], "contrast", 1.25, 3, 6), "pixelate", 2.75, 3, 6)
  assert np.array_equal(x, want) and np.array_equal(x, stream.load(6))
  pil = ArraySource(np.stack([np.asarray(Image.fromarray(i).resize((256, 256))) for i in src.images]),
                    src.labels, 10)
  pil.load = lambda i: Image.fromarray(pil.images[i])
  big = ccc.CCCSource(pil, plan, strength="imagenet")
  assert np.array_equal(np.asarray(big.load(2)), np.asarray(big.load(2))) and big.load(2).size == (224, 224)


# The harness's CCC (`pcsr_jax.ccc_stream`) on the built-in benchmark: the committed model, a short walk.
def _builtin_ccc(tmp_path, out, ckpt, **kw):
  from pcsr_jax import harness
  from pcsr_jax.experiments import builtin

  cfg = builtin.run_config(str(out), images=64, methods=("source", "tent"), setting="ccc", checkpoint=ckpt,
                           progress=False, save_predictions=True, ccc_length=192, ccc_speed=64,
                           ccc_calibration_images=16, **kw)
  lines = []
  return harness.run(cfg, log=lines.append), lines


def test_harness_ccc_on_the_builtin_benchmark(tmp_path):
  """`--setting ccc`: the checkpoint calibrated once (cached next to it), the walk streamed in order, one model,
  the walk and the calibration in results.json; the same walk again from the cache, another walk seed another
  walk."""
  import json
  import shutil

  from pcsr_jax.experiments import builtin

  ckpt = str(tmp_path / "ckpt")  # a copy: its calibration cache starts empty
  shutil.copytree(builtin.CHECKPOINT, ckpt)
  res, lines = _builtin_ccc(tmp_path, tmp_path / "a", ckpt)
  assert any("ccc: calibrating the checkpoint on 16 held-out" in l for l in lines), lines
  saved = json.loads((tmp_path / "a" / "results.json").read_text())
  walk, cal = saved["ccc"]["walk"], saved["ccc"]["calibration"]
  assert [w["start"] for w in walk] == [0, 64, 128] and saved["ccc"]["length"] == 192
  assert set(cal["curves"]) == set(ccc.NOISES[20]) and all(len(v) == 21 for v in cal["curves"].values())
  assert all(0 <= x <= 100 for v in cal["curves"].values() for x in v)
  assert (cal["images"], cal["skipped"], cal["skipped_names"]) == (16, 0, [])  # every calibration image read
  recs = res["records"]
  assert [(r["method"], r["corruption"], r["severity"], r["num_samples"]) for r in recs] == \
      [("source", "ccc", None, 192), ("tent", "ccc", None, 192)]
  pred = np.load(tmp_path / "a" / "predictions" / "source_ccc_None_seed2022.npz")
  names = pred["file_names"].tolist()
  assert names == sorted(names) and names[0].startswith("ccc00000000/")  # the walk's order, not shuffled
  # Calibration images never appear in the stream.
  calib, _ = ccc.calibration_split(10000, 16, 0)
  assert not {f"test_{i:05d}" for i in calib} & {n.split("/")[1] for n in names}
  again, lines = _builtin_ccc(tmp_path, tmp_path / "b", ckpt)
  assert any("ccc: calibration from" in l for l in lines) and not any("calibrating" in l for l in lines)
  assert json.loads((tmp_path / "b" / "results.json").read_text())["ccc"]["walk"] == walk
  assert [r["accuracy"] for r in again["records"]] == [r["accuracy"] for r in recs]
  other, _ = _builtin_ccc(tmp_path, tmp_path / "c", ckpt, corruption_seed=1)
  assert json.loads((tmp_path / "c" / "results.json").read_text())["ccc"]["walk"] != walk


@pytest.mark.parametrize("match,kw", [
    ("--ccc-target: expected a percentage 0..100", dict(ccc_target=150)),
    ("--ccc-speed: expected a positive integer.*, got 0", dict(ccc_speed=0)),
    ("--ccc-calibration-images: expected a positive integer", dict(ccc_calibration_images=-3)),
])
def test_harness_ccc_bad_values_fail_in_one_line(tmp_path, match, kw):
  from pcsr_jax import harness
  from pcsr_jax.experiments import builtin

  cfg = builtin.run_config(str(tmp_path), images=64, setting="ccc", progress=False, **kw)
  with pytest.raises(UserError, match=match) as e:
    harness.run(cfg, log=lambda *a: None)
  assert "\n" not in str(e.value)


def test_harness_ccc_needs_clean_images(tmp_path):
  import harness_fixtures as hf
  from pcsr_jax import harness

  hf.make_world(tmp_path, ("fog",), classes=2, per_class=2)
  cfg = harness.RunConfig(data=str(tmp_path / "data"), checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "o"),
                          corruptions=("fog",), setting="ccc", progress=False)
  with pytest.raises(UserError, match="--setting ccc generates its stream from clean images: give --clean-data"):
    harness.run(cfg, log=lambda *a: None)
