"""``--setting ccc``: CCC's continuously changing corruptions for a harness run (`pcsr_jax.data.generators.ccc`).

A run's CCC stream is made in three parts:

1. **Clean images.** ImageNet val from ``--clean-data`` (at ImageNet strength: flip + RandomResizedCrop(224),
   two corruptions, JPEG quality 85, as CCC's ``generate.py``), or, for the built-in benchmark, the 10,000
   Fashion-MNIST test images (CIFAR-10-C strength, no crop, no JPEG).
2. **Calibration** (in place of CCC's published ResNet-50 accuracy matrix, out of reach offline and made for
   another model). ``ccc_calibration_images`` clean images, drawn once with a fixed seed and never streamed,
   are corrupted by each corruption CCC walks for the target (14 at 40 %, 13 at 20 %, 4 at 0 %) at every
   severity of the 0.25 grid, and the run's own checkpoint classifies them: its accuracy curves, from
   which `ccc.pair_matrix` estimates every pair's matrix. ImageNet's calibration images are the release's
   centre crops (`generated.release_crop`), corrupted and JPEG-round-tripped as the stream's are. The curves
   are cached next to the checkpoint (``<checkpoint>.source_stats/ccc-calibration-<key>.json``; the key covers
   the checkpoint's params, the calibration images, the corruptions and the generators' versions), so every
   walk seed and speed of a checkpoint and target shares one calibration. A cached entry is held to the checks
   a fresh calibration gets (`ccc.curves_problem`, `ccc.clean_problem`): one that fails them, or is unreadable,
   foreign or not a file, is measured again with a log line saying why; where the entry cannot be written the
   run goes on from the fresh calibration and says so. An unreadable calibration image is left out and counted
   as the stream leaves one out (the calibration refuses when fewer than half can be read); the clean labels
   are checked against the checkpoint's head before any of this.
3. **The walk** (`ccc.make_plan`): seeded by ``--corruption-seed`` (CCC's walks 43, 44, 45 are
   ``--corruption-seed 43`` and so on), ``--ccc-target`` (0, 20, 40: CCC-Hard, -Medium, -Easy),
   ``--ccc-speed`` images per walk step, ``--ccc-length`` images (CCC: 7.5M; the built-in default: as many as
   a normal run streams, 15 x ``--images``). The harness's ``--seeds`` then seed the methods only: the stream
   is the walk's order, never shuffled. The walk and the calibration are written to results.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
from PIL import Image

from pcsr_jax import engine, files, source_stats
from pcsr_jax.data import datasets, sources, transforms
from pcsr_jax.data.generators import ccc, corruptions, generated
from pcsr_jax.errors import UserError

VERSION = 2  # bump when the calibration's procedure changes: cached curves are then recomputed (2: read counts)
CALIBRATION_SEED = 0  # which clean images calibrate (the same for every run seed: one calibration per model)
BUILTIN_LENGTH_CORRUPTIONS = 15  # the built-in default length: a normal run's 15 corruptions x --images
MIN_READABLE = 0.5  # the calibration refuses when fewer than half its images can be read (`min_readable`)


def clean_source(cfg) -> tuple[Any, str]:
  """The clean images the stream draws from, and the strength of its corruptions."""
  if cfg.dataset == "fmnist_c":
    from pcsr_jax.data import fashion_mnist
    from pcsr_jax.data.generators import fmnist_c

    images, labels = fashion_mnist.load("test", cfg.fmnist_dir)
    return fmnist_c.ArraySource(images, labels, len(fashion_mnist.CLASSES)), "cifar"
  if not cfg.clean_data:
    raise UserError("--setting ccc generates its stream from clean images: give --clean-data (ImageNet val)")
  return sources.open_images(cfg.clean_data, "--clean-data", cfg.tfds_data_dir), "imagenet"


def default_length(cfg) -> int:
  if cfg.ccc_length is not None:
    return cfg.ccc_length
  if cfg.dataset == "fmnist_c":
    return BUILTIN_LENGTH_CORRUPTIONS * (cfg.images_per_corruption or 10000)
  return ccc.LENGTH


def where(cfg) -> str:
  """How error messages name the clean images: the flag and folder, or the built-in benchmark's."""
  return f"--clean-data {cfg.clean_data}" if cfg.clean_data else "the built-in benchmark's clean images"


def min_readable(n: int) -> int:
  """How many of ``n`` calibration images must be readable: `MIN_READABLE` of them, at least one."""
  return max(1, math.ceil(MIN_READABLE * n))


def _calibration_images(clean, calib: np.ndarray, strength: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """``(images, read, skipped)``: the clean calibration images that could be read, as the model sees them
  uncorrupted (ImageNet's centre crops), their indices, and the names of those that could not be: a source's
  `sources.Unreadable`, left out as the stream's loader leaves it out (`pcsr_jax.data.loader.Loader.decode`);
  any other error is no unreadable image and propagates."""
  images, read, skipped = [], [], []
  for i in calib:
    try:
      img = clean.load(int(i))
    except sources.Unreadable:  # missing, truncated, broken, not a regular file: skipped and counted
      skipped.append(clean.names[int(i)])
      continue
    images.append(np.asarray(img, np.uint8) if strength == "cifar" else generated.release_crop(img))
    read.append(int(i))
  return (np.stack(images) if images else np.zeros((0, 1, 1, 3), np.uint8)), np.asarray(read, np.int64), skipped


def _as_streamed(x: np.ndarray, strength: str) -> np.ndarray:
  """What the stream does to an image after its corruptions: ImageNet's JPEG round trip, nothing at CIFAR
  strength."""
  return np.asarray(generated.jpeg_round_trip(x)) if strength == "imagenet" else x


def _corrupt_fn(keys: np.ndarray, strength: str, seed: int) -> Callable:
  """``(images, corruption, severity) -> images``: each calibration image as the stream would show it."""

  def corrupt(images: np.ndarray, corruption: str, severity: float) -> np.ndarray:
    return np.stack([_as_streamed(corruptions.corrupt(x, corruption, severity, seed, int(k), strength=strength),
                                  strength) for x, k in zip(images, keys)])

  return corrupt


def _accuracy_fn(model, params, meta: dict, preprocess: transforms.Preprocess, batch_size: int) -> Callable:
  """``(uint8 images, labels) -> accuracy in %`` of the checkpoint, in batches on the default device, the images
  normalized there as the engine normalizes them (`engine.normalize_uint8`)."""
  table = transforms.normalize_table(meta["mean"], meta["std"])
  forward = jax.jit(lambda p, x: model.apply({"params": p}, engine.normalize_uint8(x, table)).argmax(-1))

  def accuracy(images: np.ndarray, labels: np.ndarray) -> float:
    x = np.stack([im if im.shape[:2] == (preprocess.img_size,) * 2 else preprocess.to_uint8(Image.fromarray(im))
                  for im in images])
    correct = 0
    for a in range(0, len(x), batch_size):
      chunk = x[a:a + batch_size]
      pad = batch_size - len(chunk)  # one compiled shape
      pred = np.asarray(forward(params, np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], np.uint8)])))
      correct += int((pred[:len(chunk)] == np.asarray(labels)[a:a + len(chunk)]).sum())
    return 100.0 * correct / max(len(x), 1)

  return accuracy


def calibrate(cfg, clean, strength: str, model, params, meta: dict, preprocess: transforms.Preprocess,
              ckpt_digest: str, log) -> dict:
  """The checkpoint's accuracy curves under each corruption: ``{"curves", "clean_accuracy", "images", "skipped",
  "skipped_names", "pool"}`` (``images``: the calibration images read, ``skipped``: those unreadable, left out).

  A cache entry is used only if it passes the checks a fresh calibration does (`_load`); otherwise the
  calibration is measured again, the log saying why, and cached; where the cache cannot be written the run
  goes on from the fresh calibration and the log says so (`_save`). A model that no clean image finds
  right (`ccc.clean_problem`) or too few readable images (`min_readable`) are refused in one line."""
  calib, pool = ccc.calibration_split(len(clean), cfg.ccc_calibration_images, CALIBRATION_SEED)
  names = [clean.names[int(i)] for i in calib]
  noises = ccc.noises_for(cfg.ccc_target)
  desc = dict(version=VERSION, ccc=ccc.VERSION, generated=generated.VERSION, checkpoint=ckpt_digest,
              strength=strength, grid=ccc.GRID.tolist(), noises=list(noises), corruption_seed=cfg.corruption_seed,
              images=hashlib.sha256(json.dumps([names, np.asarray(clean.labels)[calib].tolist()]).encode())
              .hexdigest(), files=sources.files_digest(clean, calib), img_size=preprocess.img_size)
  key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
  path = os.path.join(source_stats.cache_dir_for(cfg.checkpoint, cfg.output), f"ccc-calibration-{key}.json")
  cached, why = _load(path, desc, noises, len(calib))
  if cached is not None:
    log(f"ccc: calibration from {path}{_skipped_note(cached, len(calib))}")
    return dict(cached, pool=pool)
  log(f"ccc: calibrating the checkpoint on {len(calib)} held-out clean images x {len(noises)} corruptions x "
      f"{len(ccc.GRID) - 1} severities ({why}; once per checkpoint, cached in {path})")
  images, read, skipped = _calibration_images(clean, calib, strength)
  if len(read) < min_readable(len(calib)):
    raise UserError(f"{where(cfg)}: only {len(read)} of the {len(calib)} CCC calibration images could be read "
                    f"(at least {min_readable(len(calib))} needed; unreadable: "
                    f"{', '.join(skipped[:source_stats.SKIPPED_NAMED])}"
                    f"{', ...' if len(skipped) > source_stats.SKIPPED_NAMED else ''})")
  if skipped:
    log(f"ccc: {len(skipped):,} of {len(calib):,} calibration images could not be read and were left out (e.g. "
        f"{', '.join(skipped[:source_stats.SKIPPED_NAMED])})")
  keys = np.asarray([generated.image_key(clean.names[int(i)]) for i in read], np.int64)
  curves = ccc.calibrate(images, np.asarray(clean.labels)[read],
                         _accuracy_fn(model, params, meta, preprocess, cfg.batch_size),
                         _corrupt_fn(keys, strength, cfg.corruption_seed), noises,
                         clean_fn=lambda images: np.stack([_as_streamed(x, strength) for x in images]))
  # As cached, so that a fresh run and a cached one walk the very same numbers.
  curves = {c: [round(float(v), 4) for v in a] for c, a in curves.items()}
  clean_accuracy = curves[noises[0]][0]
  why = ccc.clean_problem(clean_accuracy)
  if why:
    raise UserError(f"--checkpoint {cfg.checkpoint}: CCC calibration on {len(read)} clean images of {where(cfg)}: "
                    f"{why}")
  out = dict(describe=desc, clean_accuracy=clean_accuracy, images=len(read), skipped=len(skipped),
             skipped_names=skipped[:source_stats.SKIPPED_NAMED], curves=curves)
  _save(path, out, log)
  return dict({k: v for k, v in out.items() if k != "describe"}, pool=pool)


def _skipped_note(cal: dict, n: int) -> str:
  """The log's note of a calibration's unreadable images ("" when none)."""
  if not cal["skipped"]:
    return ""
  more = ", ..." if cal["skipped"] > len(cal["skipped_names"]) else ""
  return (f" ({cal['skipped']:,} of {n:,} calibration images unreadable, left out: "
          f"{', '.join(cal['skipped_names'])}{more})")


def _load(path: str, desc: dict, noises, n: int) -> tuple[Optional[dict], str]:
  """``(calibration, "")`` from a cache entry made from ``desc`` of ``n`` calibration images, or ``(None, why
  not)``: absent, not a file (a directory in its place), unreadable, made from another model, data or version,
  or holding what a fresh calibration cannot give (accuracies outside 0..100, NaN or null, a clean accuracy
  `ccc.clean_problem` refuses, read counts that do not add up): an edited or damaged entry, rebuilt."""
  if not os.path.isfile(path):
    return None, f"{path} is not a file" if os.path.lexists(path) else "not computed yet"
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError, RecursionError) as e:
    return None, f"{path} unreadable ({type(e).__name__})"
  if not isinstance(data, dict):
    return None, f"{path} is not a calibration"
  if data.get("describe") != json.loads(json.dumps(desc)):
    return None, "computed from another checkpoint, data or version"
  curves = data.get("curves")
  why = ccc.curves_problem(curves, noises) or ccc.clean_problem(curves[noises[0]][0])
  if not why and data.get("clean_accuracy") != curves[noises[0]][0]:
    why = f"clean_accuracy {data.get('clean_accuracy')!r:.30} is not its curves' {curves[noises[0]][0]}"
  count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  images, skipped, named = data.get("images"), data.get("skipped"), data.get("skipped_names")
  if not why and not (count(images) and count(skipped) and images + skipped == n and images >= min_readable(n)
                      and isinstance(named, list) and len(named) == min(skipped, source_stats.SKIPPED_NAMED)
                      and all(isinstance(x, str) for x in named)):
    why = f"read counts images {images!r:.20}, skipped {skipped!r:.20} are not a calibration of {n} images"
  if why:
    return None, f"{path}: {why}"
  return dict(clean_accuracy=curves[noises[0]][0], images=images, skipped=skipped, skipped_names=named,
              curves=curves), ""


def _save(path: str, out: dict, log) -> None:
  """Caches a fresh calibration; where it cannot be written (a directory in the way, an immutable or read-only
  entry) the run goes on from the fresh one, and the log says it was not cached."""
  try:
    files.write_json(path, out, indent=1)
  except OSError as e:
    log(f"ccc: calibration not cached: cannot write {path} ({e.strerror or type(e).__name__}); this run uses "
        f"the fresh calibration")
    return
  log(f"ccc: calibration saved to {path}")


def build(cfg, model, params, meta: dict, preprocess: transforms.Preprocess, ckpt_digest: str, log
          ) -> tuple[ccc.CCCSource, dict]:
  """The run's CCC source and what results.json records of it (the calibration and the walk)."""
  clean, strength = clean_source(cfg)
  # The clean labels against the checkpoint's head before any calibration work (the harness checks every
  # stream's labels again after, as it does every domain's).
  sources.check_classes(clean, meta["num_classes"], datasets.get(cfg.dataset).class_subset(), where(cfg))
  cal = calibrate(cfg, clean, strength, model, params, meta, preprocess, ckpt_digest, log)
  curves = {c: np.asarray(v, np.float64) for c, v in cal["curves"].items()}
  plan = ccc.make_plan(curves, cal["clean_accuracy"], cfg.ccc_target, cfg.ccc_speed, default_length(cfg),
                       cal["pool"], cfg.corruption_seed)
  src = ccc.CCCSource(clean, plan, strength)
  log(f"ccc: target {cfg.ccc_target:g}%, speed {cfg.ccc_speed}, {plan.length:,} images in {len(plan.start):,} walk "
      f"steps over {len(plan.noises)} corruptions, walk seed {cfg.corruption_seed}; the checkpoint's clean "
      f"calibration accuracy {cal['clean_accuracy']:.1f}%")
  record = dict(target=cfg.ccc_target, speed=cfg.ccc_speed, length=plan.length, seed=cfg.corruption_seed,
                strength=strength, calibration=dict(images=cal["images"], skipped=cal["skipped"],
                                                    skipped_names=cal["skipped_names"],
                                                    clean_accuracy=cal["clean_accuracy"], curves=cal["curves"],
                                                    grid=ccc.GRID.tolist()),
                walk=plan.walk())
  return src, record
