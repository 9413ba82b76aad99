"""CCC, continuously changing corruptions (Press et al. 2023, "RDumb"; ``oripress/CCC``), as a stream source.

CCC streams ImageNet val images under two corruptions at a time whose severities walk over a grid (0 to 5 in
steps of 0.25) so that a baseline model's accuracy stays near a target (0, 20 or 40 %). For every ordered
pair of corruptions, `find_path` picks a walk over the pair's 21 x 21 accuracy matrix that starts with the
first corruption alone (s1 > 0, s2 = 0) and ends with the second alone (s1 = 0). The stream (``generate.py``
there) draws a random first pair; when a walk ends, its second corruption becomes the first and a new second
is drawn. Each walk step holds ``speed`` images (1000, 2000 or 5000 in the paper), drawn at random from val.
Each image: RandomHorizontalFlip, RandomResizedCrop(224), corruption 1 at s1 if s1 > 0, ``np.uint8``,
corruption 2 at s2 if s2 > 0, ``np.uint8``, JPEG quality 85 (``optimize=True``). A run is 7.5M images.

Departures from the official code, all forced or deliberate:

- **Calibration instead of the published matrix.** CCC downloads ``ccc_accuracy_matrix.pickle``: a
  ResNet-50's accuracy for every ordered pair and every (s1, s2) of the grid. It is out of reach offline and
  made for another model. Here the source model itself is calibrated (`calibrate`) on a held-out subset of
  the clean images, which the stream then never shows (`calibration_split`): its accuracy under each single
  corruption over the grid, ``curves[c][k]``. The pair matrix is estimated from those curves by
  `pair_matrix`, assuming the two corruptions destroy correct predictions independently:
  ``acc(c1, s1, c2, s2) ~ acc_c1(s1) * acc_c2(s2) / acc_clean``. That keeps the calibration at 14 x 20
  evaluations instead of 182 x 440, agrees with the measured curves on the matrix's edges (one severity 0)
  where CCC's walks start and end, and is symmetric in the order while the real composition is not (the
  second corruption acts on the first's output). It overestimates the pair's accuracy: measured on the
  built-in benchmark, it is 6.4 points too high on average, a smaller error than ``min`` (see `pair_matrix`).
- **Random numbers.** CCC draws the pairs with Python's ``random``, the images with numpy's global generator
  and the crops with torch's, all seeded once and consumed in order. Here the walk and the images come from
  numpy Generators seeded by ``seed`` (`make_plan`), and every position ``k``'s crop and corruptions from
  keys of ``(seed, k)``, so one position regenerates alone: resume, worker processes and ``--limit`` see
  the same pixels. The walk itself is the official one given the same matrix and draws; the pixels cannot
  match CCC's files (which also come from its authors' servers, unreachable offline).
- **Small pools.** CCC takes each step's images as a prefix of a shuffled val (no repeats within a step).
  When ``speed`` exceeds the pool (a small built-in run), successive shuffles of the pool are concatenated.
- **CIFAR strength (the built-in 32 x 32 Fashion-MNIST images).** The two corruptions only, at the CIFAR-10-C
  tables: no flip, no crop and no JPEG round trip, as CIFAR-10-C is stored losslessly and its images are not
  cropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
from PIL import Image

from pcsr_jax.data.generators import corruptions, generated
from pcsr_jax.errors import UserError

VERSION = 1  # bump when the plan or the pixels of a position change (it is part of `CCCSource.describe`)
GRID = np.arange(21) * 0.25  # severities 0, 0.25, ..., 5; 0 = not corrupted
TARGETS = (0, 20, 40)  # CCC-Hard, -Medium, -Easy (the baseline's accuracy in %)
SPEEDS = (1000, 2000, 5000)
LENGTH = 7_500_000  # images in a CCC run
STRENGTHS = ("cifar", "imagenet")
# `make_plan`'s bounds. The plan holds 4 bytes per image (``image``, int32) and 12 per walk step (``c1``, ``c2``,
# ``s1``, ``s2``, ``start``). Measured with tracemalloc (14 corruptions, a 49,500-image pool): a 5M-image plan
# peaks at 4.1 bytes per image at speeds 1000 and 5000, a 100k-image one at 16.6 at speed 1. Ten CCC runs are
# then at most 0.29 GiB at CCC's speeds and 1.2 GiB at speed 1. A speed above the length only cuts the first
# step, so the speed has the same bound.
MAX_LENGTH = 10 * LENGTH
MAX_SPEED = MAX_LENGTH
# results.json records the walk step by step (`Plan.walk`: about 81 bytes of JSON a step): CCC's longest run at
# its slowest speed is 7,500 steps; ten times CCC's length at its slowest, 75,000. At most 100,000 steps (8 MB).
MAX_STEPS = 100_000
MIN_CLEAN_ACCURACY = 1.0  # %: a model at or below it has no accuracy to walk down from

# The corruptions walked for each target (``generate.py``), in our names ("elastic" and "jpeg" there).
# Those too mild to reach a target even at severity 5 are left out: brightness always; JPEG, pixelate and
# the blurs, elastic, snow, frost and fog below 20 %.
_EASY = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
         "zoom_blur", "snow", "frost", "fog", "contrast", "elastic_transform", "pixelate", "jpeg_compression")
NOISES = {40: _EASY, 20: _EASY[:-1], 0: ("gaussian_noise", "shot_noise", "impulse_noise", "contrast")}

_OFF_GRID = 9999999999999.0  # `find_path`'s cost past the last column (CCC's value): never the better move
_CROP_KEY = 0x63726F70  # separates the crop's random stream from the others keyed by (seed, k)


def noises_for(target: float) -> tuple[str, ...]:
  """The corruption list CCC uses for ``target`` (its thresholds: >= 40, >= 20, else)."""
  return NOISES[40] if target >= 40 else NOISES[20] if target >= 20 else NOISES[0]


def curves_problem(curves: Any, noises: Sequence[str], grid: np.ndarray = GRID) -> str:
  """Why ``curves`` is not a calibration of ``noises`` over ``grid`` ("" when it is): one curve per corruption
  and no other, ``len(grid)`` accuracies each, every one a finite number in 0..100 (a percentage), and one clean
  accuracy (``grid[0]`` = 0) shared by all the curves.

  The one rule for every calibration: `calibrate` raises on a fresh one that breaks it, `make_plan` refuses
  it, and ``pcsr_jax.ccc_stream`` rebuilds a cached one that breaks it (an edited or damaged cache file)."""
  if not isinstance(curves, Mapping):
    return f"expected a mapping of corruption to accuracies, got {type(curves).__name__}"
  missing = [c for c in noises if c not in curves]
  if missing:
    return f"no curve for {', '.join(missing)}"
  extra = sorted(str(c) for c in curves if c not in noises)
  if extra:
    return f"a curve for {extra[0]}, which the walk does not use"
  clean = None
  for c in noises:
    v = curves[c]
    if not isinstance(v, (list, tuple, np.ndarray)) or np.ndim(v) != 1 or len(v) != len(grid):
      return f"{c}'s curve: expected {len(grid)} accuracies (one per severity of the grid), got {v!r:.60}"
    for s, a in zip(grid, v):
      what = "clean" if s == 0 else f"{c} {s:g}"
      if isinstance(a, (bool, np.bool_)) or not isinstance(a, numbers.Real):
        return f"accuracy {a!r:.30} at {what} is not a number"
      if not (math.isfinite(a) and 0 <= a <= 100):
        return f"accuracy {a} at {what} outside 0..100 (a percentage is expected)"
    if clean is None:
      clean = v[0]
    elif v[0] != clean:
      return f"{c}'s clean accuracy {v[0]} differs from {noises[0]}'s {clean}"
  return ""


def clean_problem(clean_accuracy: float) -> str:
  """Why a model of this clean accuracy (%) cannot be walked ("" when it can): at `MIN_CLEAN_ACCURACY` or below
  no pair of corruptions can bring it to a target, and a fraction (0..1) in place of a percentage lands there."""
  if clean_accuracy <= MIN_CLEAN_ACCURACY:
    return (f"clean accuracy {clean_accuracy:g}%: accuracies are percentages (0..100), and a model at "
            f"{MIN_CLEAN_ACCURACY:g}% or less cannot hold a target")
  return ""


def find_path(acc: np.ndarray, target: float) -> list[tuple[int, int]]:
  """CCC's walk over an accuracy matrix ``acc[i, j]`` (s1 = grid[i], s2 = grid[j]) for ``target``.

  Walks start at (i, 0), i >= 1, move to (i - 1, j) or (i, j + 1), and end on row 0. Each cell keeps one
  path to row 0: of its two moves, the one whose path mean (this cell included) is closer to the target;
  a tie goes to (i, j + 1). Past the last column the cost is CCC's 9999999999999 on a path of length 1,
  so that move is never taken for finite accuracies. Of the starts, the first (smallest i) whose path mean
  is closest to the target wins. CCC computes this by memoized recursion (`traverse_graph`); here the same
  cells are filled row by row, right to left, in the same float64 arithmetic, so paths and ties agree
  (``benchmarks/torch_methods/ccc_walk.py`` holds the recursive form, and the tests compare the two).
  """
  acc = np.asarray(acc, np.float64)
  if acc.ndim != 2 or acc.shape[0] < 2 or acc.shape[1] < 1:
    raise ValueError(f"accuracy matrix: expected 2-D with at least 2 rows, got shape {acc.shape}")
  if not np.isfinite(acc).all():
    raise ValueError("accuracy matrix: non-finite values")
  n, m = acc.shape
  cost = np.zeros((n, m + 1))
  length = np.ones((n, m + 1), np.int64)
  up = np.zeros((n, m), bool)  # the move kept at (i, j): up to (i - 1, j), else right to (i, j + 1)
  cost[:, m] = _OFF_GRID
  cost[0, :m] = acc[0]
  for i in range(1, n):
    for j in range(m - 1, -1, -1):
      a = acc[i, j]
      d_up = abs((cost[i - 1, j] + a) / (length[i - 1, j] + 1) - target)
      d_right = abs((cost[i, j + 1] + a) / (length[i, j + 1] + 1) - target)
      up[i, j] = d_up < d_right
      ni, nj = (i - 1, j) if up[i, j] else (i, j + 1)
      cost[i, j] = cost[ni, nj] + a
      length[i, j] = length[ni, nj] + 1
  dist = np.abs(cost[1:, 0] / length[1:, 0] - target)
  i, j = 1 + int(np.argmin(dist)), 0  # argmin: the first of equal distances, as CCC's strict "<"
  path = [(i, j)]
  while i > 0:
    i, j = (i - 1, j) if up[i, j] else (i, j + 1)
    if j == m:
      raise ValueError("accuracy matrix: the walk left the grid (accuracies far from the target's scale)")
    path.append((i, j))
  return path


def pair_matrix(curves: Mapping[str, np.ndarray], c1: str, c2: str, clean_accuracy: float) -> np.ndarray:
  """The estimated accuracy of ``c2`` applied on top of ``c1``: ``[i, j]`` at s1 = grid[i], s2 = grid[j].

  ``curves[c1][i] * curves[c2][j] / clean``: each corruption keeps a fraction ``acc_c(s) / clean`` of the
  correct predictions, independently of the other. Row 0 and column 0 are the measured single-corruption
  curves (``curves[c][0]`` is the clean accuracy).

  Measured on the built-in benchmark (``assets/fmnist_vit``, CIFAR-10-C strength, 500 held-out test images,
  integer severities 1..5 on both corruptions, 10 random ordered pairs of ``NOISES[40]``; the two corruptions
  applied in turn as `CCCSource` does): against the measured pair accuracies, the product is off by 6.7
  points on average and too high in 9 of 10 pairs (bias +6.4: corruptions compound more than independently,
  most for contrast with fog, +18), the other simple choice ``min(acc_c1, acc_c2)`` by 9.6 (bias +9.4). The walks
  `find_path` picks from the product hold the measured accuracy 23.2 points from a 40 % target on average,
  those it picks from the measured matrices 21.1 (at 20 %, 35.6 and 35.9: there this model stays above the
  target even at severity 5 for most pairs, and every walk climbs to the top severities).
  ``python -m benchmarks.ccc_pair_matrix`` measures it (``experiments/results/ccc_pair_matrix.txt``).
  """
  if clean_accuracy <= 0:
    raise UserError(f"ccc calibration: clean accuracy {clean_accuracy}% leaves nothing to walk")
  return np.outer(curves[c1], curves[c2]) / clean_accuracy


def calibration_split(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """``(calibration, pool)``: a random ``size``-image calibration subset of ``n`` clean images (sorted) and
  the rest, the stream's pool."""
  if not 0 < size < n:
    raise UserError(f"ccc calibration images: expected 1 to {n - 1} (of {n} clean images), got {size}")
  calib = np.sort(np.random.default_rng([seed, n, size]).choice(n, size, replace=False))
  return calib, np.setdiff1d(np.arange(n), calib)


def calibrate(images: np.ndarray, labels: np.ndarray, accuracy_fn: Callable[[np.ndarray, np.ndarray], float],
              corrupt_fn: Callable[[np.ndarray, str, float], np.ndarray], noises: Sequence[str],
              grid: np.ndarray = GRID, clean_fn: Optional[Callable[[np.ndarray], np.ndarray]] = None
              ) -> dict[str, np.ndarray]:
  """The model's accuracy (%) under each corruption of ``noises`` alone over ``grid``: ``{c: [len(grid)]}``.

  ``images``: the calibration subset, uint8 [n, H, W, 3]; ``accuracy_fn(images, labels)``: the model's
  accuracy in percent (CCC's targets are percentages); ``corrupt_fn(images, corruption, severity)``: the
  corrupted uint8 images. ``grid[0]`` must be 0, no corruption: the clean accuracy, measured once on
  ``clean_fn(images)`` (what the stream does to an uncorrupted image, e.g. its JPEG round trip; default as is).
  The curves are checked by `curves_problem` (a ``ValueError`` if ``accuracy_fn`` gives no percentages), the
  rule a cached calibration is held to as well.
  """
  grid = np.asarray(grid, np.float64)
  if grid.ndim != 1 or len(grid) < 2 or grid[0] != 0 or not (np.diff(grid) > 0).all():
    raise ValueError(f"ccc grid: expected increasing severities from 0, got {grid.tolist()}")

  clean = float(accuracy_fn(images if clean_fn is None else clean_fn(images), labels))
  curves = {c: np.asarray([clean] + [float(accuracy_fn(corrupt_fn(images, c, float(s)), labels)) for s in grid[1:]])
            for c in noises}
  why = curves_problem(curves, noises, grid)
  if why:
    raise ValueError(f"ccc calibration: {why}")
  return curves


@dataclasses.dataclass(frozen=True, eq=False)  # arrays inside: compare `digest`s
class Plan:
  """A CCC stream: its walk steps and, per position, the clean image.

  Step ``t`` holds positions ``start[t]`` to ``start[t] + speed - 1`` (the last one may be cut by
  ``length``): corruption ``noises[c1[t]]`` at ``grid[s1[t]]`` then ``noises[c2[t]]`` at ``grid[s2[t]]``.
  ``image[k]``: position k's index into the clean source. Arrays only, ~4 bytes per position.
  """

  seed: int
  target: float
  speed: int
  length: int
  noises: tuple[str, ...]
  grid: np.ndarray
  c1: np.ndarray  # [steps] int8 indices into noises
  c2: np.ndarray
  s1: np.ndarray  # [steps] int8 indices into grid
  s2: np.ndarray
  start: np.ndarray  # [steps] int64 first position
  image: np.ndarray  # [length] int32 indices into the clean source

  def at(self, k: int) -> tuple[str, float, str, float]:
    """Position ``k``'s ``(corruption 1, severity 1, corruption 2, severity 2)``."""
    t = k // self.speed
    return (self.noises[self.c1[t]], float(self.grid[self.s1[t]]),
            self.noises[self.c2[t]], float(self.grid[self.s2[t]]))

  def walk(self) -> list[dict[str, Any]]:
    """The steps as JSON-able records, for the results file."""
    return [dict(pair=[self.noises[a], self.noises[b]], s1=float(self.grid[i]), s2=float(self.grid[j]),
                 start=int(p)) for a, b, i, j, p in zip(self.c1, self.c2, self.s1, self.s2, self.start)]

  def digest(self) -> str:
    h = hashlib.sha256(json.dumps([self.seed, self.target, self.speed, self.length, self.noises,
                                   np.asarray(self.grid).tolist()]).encode())
    for a in (self.c1, self.c2, self.s1, self.s2, self.start, self.image):
      h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _draw_other(rng: np.random.Generator, n: int, other: int) -> int:
  """CCC's redraw-until-different, over indices (one draw per try, as its loop)."""
  while True:
    x = int(rng.integers(n))
    if x != other:
      return x


def check_steps(length: int, speed: int) -> None:
  """At most `MAX_STEPS` walk steps of ``speed`` images over ``length`` images; else one line naming the flags."""
  steps = -(-length // speed)
  if steps > MAX_STEPS:
    raise UserError(f"--ccc-speed {speed}: {steps:,} walk steps over {length:,} images, expected at most "
                    f"{MAX_STEPS:,} (each is recorded in results.json); raise --ccc-speed or lower --ccc-length")


def make_plan(curves: Mapping[str, np.ndarray], clean_accuracy: float, target: float, speed: int, length: int,
              pool: Sequence[int], seed: int, grid: np.ndarray = GRID) -> Plan:
  """The CCC walk for ``target`` (%) over the calibration ``curves`` (`calibrate`), ``length`` positions.

  ``pool``: the clean-source indices the stream may show (the calibration subset left out). The walk
  (pairs) and the images come from two Generators of ``seed``, and the last step's images are drawn in
  full before the cut, so a plan is a prefix of any longer plan with the same arguments. ``length`` and
  ``speed`` are at most `MAX_LENGTH` and `MAX_SPEED` (the plan's memory grows with both).
  """
  why = clean_problem(clean_accuracy)
  if why:
    raise UserError(f"ccc: {why}")
  if not 0 <= target <= 100:
    raise UserError(f"ccc target: expected a percentage 0..100, got {target}")
  for flag, v, top, note in (("--ccc-length", length, MAX_LENGTH, "10 x CCC's run; 4 bytes of plan per image"),
                             ("--ccc-speed", speed, MAX_SPEED, "images per walk step, the longest length")):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or not 1 <= v <= top:
      raise UserError(f"{flag}: expected an integer 1 to {top:,} ({note}), got {v}")
  speed, length = int(speed), int(length)
  check_steps(length, speed)
  pool = np.asarray(pool, np.int64)
  if pool.ndim != 1 or len(pool) == 0 or pool.min() < 0 or pool.max() >= 2**31:
    raise UserError("ccc: the image pool must be a non-empty list of image indices")
  noises = noises_for(target)
  grid = np.asarray(grid, np.float64)
  why = curves_problem({c: v for c, v in curves.items() if c in noises}, noises, grid)
  if why:
    raise UserError(f"ccc calibration: {why}")
  walks = {(a, b): np.asarray(find_path(pair_matrix(curves, noises[a], noises[b], clean_accuracy), target), np.int8)
           for a in range(len(noises)) for b in range(len(noises)) if a != b}
  # The steps: whole walks one after another, the last one cut; each walk's second corruption is the next's first.
  n_steps = -(-length // speed)
  c1, c2, s1, s2 = (np.empty(n_steps, np.int8) for _ in range(4))
  pair_rng = np.random.default_rng([seed, 0])
  a = int(pair_rng.integers(len(noises)))
  b = _draw_other(pair_rng, len(noises), a)
  t = 0
  while t < n_steps:
    path = walks[(a, b)][:n_steps - t]
    c1[t:t + len(path)], c2[t:t + len(path)] = a, b
    s1[t:t + len(path)], s2[t:t + len(path)] = path[:, 0], path[:, 1]
    t += len(path)
    a, b = b, _draw_other(pair_rng, len(noises), b)
  # The images: each step's drawn in full (a plan is a prefix of a longer one), the part within the length kept.
  image_rng = np.random.default_rng([seed, 1])
  image = np.empty(length, np.int32)
  n = len(pool)
  for t in range(n_steps):
    lo, hi = t * speed, min((t + 1) * speed, length)
    if speed <= n:
      image[lo:hi] = pool[image_rng.choice(n, speed, replace=False)[:hi - lo]]
      continue
    for first in range(lo, lo + speed, n):  # whole shuffles of the pool, one after another
      order = image_rng.permutation(n)
      if first < hi:
        image[first:min(first + n, hi)] = pool[order[:hi - first]]
  start = np.arange(n_steps, dtype=np.int64)
  start *= speed  # in place: no second array of steps
  return Plan(seed=int(seed), target=float(target), speed=speed, length=length, noises=noises, grid=grid,
              c1=c1, c2=c2, s1=s1, s2=s2, start=start, image=image)


def crop_params(width: int, height: int, rng: np.random.Generator, scale: tuple[float, float] = (0.08, 1.0),
                ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
  """torchvision's ``RandomResizedCrop.get_params``, ``(top, left, h, w)``, with ``rng`` for torch's generator:
  10 tries of a random area fraction in ``scale`` and a log-uniform aspect ratio in ``ratio``, else a centre
  crop clamped to the ratio range. (torch draws float32 uniforms; these are float64.)"""
  area = height * width
  log_ratio = np.log(ratio)
  for _ in range(10):
    target_area = area * rng.uniform(scale[0], scale[1])
    aspect = np.exp(rng.uniform(log_ratio[0], log_ratio[1]))
    w = int(round(np.sqrt(target_area * aspect)))
    h = int(round(np.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    w, h = int(round(height * max(ratio))), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(img: Image.Image, rng: np.random.Generator, size: int = 224) -> Image.Image:
  """torchvision's ``RandomResizedCrop(size)`` on a PIL image: `crop_params`, then crop and bilinear resize
  (torchvision's default interpolation, which on PIL is ``crop`` + ``resize``)."""
  top, left, h, w = crop_params(*img.size, rng)
  return img.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)


class _Names(Sequence):
  """Position k's name, made on demand (a run has 7.5M): ``ccc<k>/<clean image's name>``."""

  def __init__(self, clean_names: Sequence[str], image: np.ndarray):
    self.clean_names, self.image = clean_names, image

  def __len__(self) -> int:
    return len(self.image)

  def __getitem__(self, k):
    if isinstance(k, slice):
      return [self[i] for i in range(*k.indices(len(self)))]
    k = int(k)
    if not -len(self) <= k < len(self):
      raise IndexError(k)
    k %= len(self)
    return f"ccc{k:08d}/{self.clean_names[int(self.image[k])]}"


class CCCSource:
  """The CCC stream of `Plan` ``plan`` over the ``clean`` source, in the harness's source interface.

  ``load(k)`` regenerates position k alone from ``(plan.seed, k)``. ``strength="imagenet"`` (PIL images of
  any size in): flip and RandomResizedCrop(224) with a Generator keyed by ``(seed, k)``, the two corruptions
  at ImageNet strength through `corruptions.corrupt` (``np.uint8`` after each), a JPEG quality-85 round
  trip; a PIL image out. ``strength="cifar"`` (the built-in 32 x 32 uint8 arrays): the two corruptions at
  CIFAR-10-C strength only; a uint8 array out.
  """

  def __init__(self, clean, plan: Plan, strength: str = "cifar"):
    if strength not in STRENGTHS:
      raise UserError(f"ccc strength: expected one of {', '.join(STRENGTHS)}, got '{strength}'")
    if len(plan.image) and int(plan.image.max()) >= len(clean):
      raise UserError(f"ccc: the plan indexes image {int(plan.image.max())} of a {len(clean)}-image source")
    self.clean, self.plan, self.strength = clean, plan, strength
    self.labels = np.asarray(clean.labels)[plan.image]
    self.names = _Names(clean.names, plan.image)
    self.num_label_classes = clean.num_label_classes
    self.imagenet_labels = clean.imagenet_labels
    # What generates the stream, for the resume key (the plan's digest covers the calibrated walk).
    self.describe = (f"ccc v{VERSION} target {plan.target:g} speed {plan.speed} seed {plan.seed} length "
                     f"{plan.length} strength {strength} clean {len(clean)} plan {plan.digest()[:16]}")

  def __len__(self) -> int:
    return self.plan.length

  def load(self, k: int):
    k = int(k)
    c1, s1, c2, s2 = self.plan.at(k)
    img = self.clean.load(int(self.plan.image[k]))
    imagenet = self.strength == "imagenet"
    if imagenet:
      rng = np.random.default_rng([self.plan.seed, k, _CROP_KEY])
      img = Image.fromarray(img) if isinstance(img, np.ndarray) else img.convert("RGB")
      if rng.random() < 0.5:  # RandomHorizontalFlip, before the crop as in CCC's Compose
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
      img = random_resized_crop(img, rng)
    x = np.asarray(img, np.uint8)
    for c, s in ((c1, s1), (c2, s2)):
      if s > 0:
        x = corruptions.corrupt(x, c, s, self.plan.seed, k, strength=self.strength)
    return generated.jpeg_round_trip(x) if imagenet else x  # CCC's storage: quality 85, optimize=True
