"""``--setting ccc``: CCC's continuously changing corruptions for a harness run (`pcsr_jax.data.ccc`).

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
   walk seed and speed of a checkpoint and target shares one calibration.
3. **The walk** (`ccc.make_plan`): seeded by ``--corruption-seed`` (CCC's walks 43, 44, 45 are
   ``--corruption-seed 43`` and so on), ``--ccc-target`` (0, 20, 40: CCC-Hard, -Medium, -Easy),
   ``--ccc-speed`` images per walk step, ``--ccc-length`` images (CCC: 7.5M; the built-in default: as many as
   a normal run streams, 15 x ``--images``). The harness's ``--seeds`` then seed the methods only: the stream
   is the walk's order, never shuffled. The walk and the calibration are written to results.json.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
from PIL import Image

from pcsr_jax import engine, files, source_stats
from pcsr_jax.data import ccc, corruptions, generated, sources, transforms
from pcsr_jax.errors import UserError

VERSION = 1  # bump when the calibration's procedure changes: cached curves are then recomputed
CALIBRATION_SEED = 0  # which clean images calibrate (the same for every run seed: one calibration per model)
BUILTIN_LENGTH_CORRUPTIONS = 15  # the built-in default length: a normal run's 15 corruptions x --images


def clean_source(cfg) -> tuple[Any, str]:
  """The clean images the stream draws from, and the strength of its corruptions."""
  if cfg.dataset == "fmnist_c":
    from pcsr_jax.data import fashion_mnist, fmnist_c

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


def _calibration_images(clean, calib: np.ndarray, strength: str) -> np.ndarray:
  """The clean calibration images as the model sees them uncorrupted: ImageNet's centre crops."""
  if strength == "cifar":
    return np.stack([np.asarray(clean.load(int(i)), np.uint8) for i in calib])
  return np.stack([generated.release_crop(clean.load(int(i))) for i in calib])


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
  """The checkpoint's accuracy curves under each corruption (cached): ``{"curves", "clean_accuracy",
  "images", ...}``."""
  calib, pool = ccc.calibration_split(len(clean), cfg.ccc_calibration_images, CALIBRATION_SEED)
  names = [clean.names[int(i)] for i in calib]
  keys = np.asarray([generated.image_key(n) for n in names], np.int64)
  noises = ccc.noises_for(cfg.ccc_target)
  desc = dict(version=VERSION, ccc=ccc.VERSION, generated=generated.VERSION, checkpoint=ckpt_digest,
              strength=strength, grid=ccc.GRID.tolist(), noises=list(noises), corruption_seed=cfg.corruption_seed,
              images=hashlib.sha256(json.dumps([names, np.asarray(clean.labels)[calib].tolist()]).encode())
              .hexdigest(), files=sources.files_digest(clean, calib), img_size=preprocess.img_size)
  key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
  path = os.path.join(source_stats.cache_dir_for(cfg.checkpoint, cfg.output), f"ccc-calibration-{key}.json")
  cached = _load(path, desc, noises)
  if cached is not None:
    log(f"ccc: calibration from {path}")
    return dict(cached, pool=pool)
  log(f"ccc: calibrating the checkpoint on {len(calib)} held-out clean images x {len(noises)} corruptions x "
      f"{len(ccc.GRID) - 1} severities (once per checkpoint; cached in {path})")
  images = _calibration_images(clean, calib, strength)
  labels = np.asarray(clean.labels)[calib]
  curves = ccc.calibrate(images, labels, _accuracy_fn(model, params, meta, preprocess, cfg.batch_size),
                         _corrupt_fn(keys, strength, cfg.corruption_seed), noises,
                         clean_fn=lambda images: np.stack([_as_streamed(x, strength) for x in images]))
  out = dict(describe=desc, clean_accuracy=float(next(iter(curves.values()))[0]), images=len(calib),
             curves={c: [round(float(v), 4) for v in a] for c, a in curves.items()})
  files.write_json(path, out, indent=1)
  return dict(out, pool=pool)


def _load(path: str, desc: dict, noises) -> Optional[dict]:
  """A cached calibration made from ``desc``, or None (absent, unreadable, another model or data)."""
  try:
    with open(path) as f:
      data = json.load(f)
    curves = data["curves"]
    ok = (data["describe"] == json.loads(json.dumps(desc)) and set(curves) == set(noises) and
          all(len(curves[c]) == len(ccc.GRID) for c in noises))
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return data if ok else None


def build(cfg, model, params, meta: dict, preprocess: transforms.Preprocess, ckpt_digest: str, log
          ) -> tuple[ccc.CCCSource, dict]:
  """The run's CCC source and what results.json records of it (the calibration and the walk)."""
  clean, strength = clean_source(cfg)
  cal = calibrate(cfg, clean, strength, model, params, meta, preprocess, ckpt_digest, log)
  curves = {c: np.asarray(v, np.float64) for c, v in cal["curves"].items()}
  plan = ccc.make_plan(curves, cal["clean_accuracy"], cfg.ccc_target, cfg.ccc_speed, default_length(cfg),
                       cal["pool"], cfg.corruption_seed)
  src = ccc.CCCSource(clean, plan, strength)
  log(f"ccc: target {cfg.ccc_target:g}%, speed {cfg.ccc_speed}, {plan.length:,} images in {len(plan.start):,} walk "
      f"steps over {len(plan.noises)} corruptions, walk seed {cfg.corruption_seed}; the checkpoint's clean "
      f"calibration accuracy {cal['clean_accuracy']:.1f}%")
  record = dict(target=cfg.ccc_target, speed=cfg.ccc_speed, length=plan.length, seed=cfg.corruption_seed,
                strength=strength, calibration=dict(images=cal["images"], clean_accuracy=cal["clean_accuracy"],
                                                    curves=cal["curves"], grid=ccc.GRID.tolist()),
                walk=plan.walk())
  return src, record
