"""The 19 Hendrycks corruptions at two strengths: CIFAR-10-C's (32 px) and ImageNet-C's (224 px).

``TABLES[strength][corruption]`` holds the severity rows 1..5 as the releases
write them: ``make_cifar_c.py`` for ``"cifar"`` (the built-in Fashion-MNIST-C
benchmark, 32 px, where ImageNet-C's tables would erase the image) and
``make_imagenet_c.py`` for ``"imagenet"`` (both in ``hendrycks/robustness``),
oddities included (ImageNet elastic's factors of 244 where 224 was meant).
The functions ``fn(x, c)`` take an HWC uint8 image of any size and a row ``c``.
They are ours, written from the releases and built on the primitives of the
``imagecorruptions`` package: its anti-aliased disk kernel, plasma fractal,
numpy reimplementation of ImageMagick's motion blur (the releases used Wand),
numba pixel shuffle of glass blur, and its frost photos.

Where the ImageNet release differs from the CIFAR code, ``FUNCTIONS["imagenet"]``
follows it: frost crops the photos at full size (CIFAR shrinks them 0.2x), zoom
blur and snow zoom with scipy as the release does (bit for bit; the CIFAR path
uses an equivalent matrix form, equal to float rounding), and snow truncates its
flake layer to 8 bits before the motion blur as the release's PNG did. The fog
map is the next power of two at or above the image side (32 at 32 px, 256 at
224 px: the release's sizes), cropped to the image. Departures from the release,
at both strengths: the plasma map is float32 (the package's; the release's is
float64); motion blur is the package's numpy kernel, with ImageMagick's kernel
width ``2 * ceil(radius) + 1`` for fractional radii; glass blur's pixel swaps
draw from the package's numba generator, seeded from numpy's; impulse noise
draws from a generator seeded from numpy's (scikit-image no longer uses numpy's
global one); the CIFAR snow layer is rounded to 8 bits where the release
truncated (kept so that the built-in benchmark's cached data stays valid).
The package's own ImageNet-C functions depart from the release where ours do
not: impulse noise (unseeded), frost (six photos, enlarged 1.1x), elastic
(rewritten), snow (flakes blurred unquantized, and before trimming a zoomed
layer larger than the image), spatter's mud (a float64 colour), pixelate
(NEAREST upsampling) and zoom blur (a corner crop, not a centred trim). With
the same numpy seed, ours and the package's give the same pixels for gaussian,
shot and speckle noise, glass and motion blur, fog and watery spatter
(tests/test_corruptions.py).

Fractional severities (`params`) follow CCC (``oripress/CCC``,
``make_imagenet_c.py``): severities 0..5, the rows interpolated linearly
between neighbours, with a row 0 that (nearly) leaves the image alone; as CCC's
generator, severity 0 returns the image unchanged. See `params` for the rows
that are not plain numbers. Above 0, severities start at
`MIN_FRACTIONAL_SEVERITY` (0.01): below it no path computes every corruption
faithfully (`check_fractional_severity`, the check of the ``--severity`` flag;
``benchmarks/device_small_severity.py`` measures both paths down to 1e-300).
Corruption seeds are integers from 0 to 2**32 - 1 (`check_seed`).

Randomness comes from numpy's global generator, which `corrupt` seeds for every
image from ``(seed, corruption, severity, image index)`` under a lock (the
loader decodes in threads): each image's corruption is reproducible on its own,
whatever else was generated before it or alongside it.
"""

from __future__ import annotations

import functools
import importlib.resources
import io
import math
import threading
import warnings
import zlib
from typing import Any

import numpy as np
from PIL import Image

from pcsr_jax.data.imagenet import CORRUPTIONS, HELDOUT_CORRUPTIONS, SHORT_NAMES
from pcsr_jax.errors import UserError

# The 15 benchmark corruptions (ImageNet-C order), then the 4 held-out ones used for tuning.
BENCHMARK = CORRUPTIONS
HELDOUT = HELDOUT_CORRUPTIONS
ALL = BENCHMARK + HELDOUT
SHORT = SHORT_NAMES  # table headers
SIZE = 32  # the built-in benchmark's image size
STRENGTHS = ("cifar", "imagenet")
MAX_SEVERITY = 5  # severities run from 0 (no corruption) to 5, fractions allowed (CCC's range)
# The smallest severity above 0 that every path takes (host and device, both strengths); 0 itself is the clean
# image. Measured (``benchmarks/device_small_severity.py``): the host's shot noise raises numpy's "lam value too
# large" below ~6.5e-18 (60 / s photons past ~9.2e18) and its motion blur is NaN at 1e-300 (sigma squared
# underflows); on the device contrast stops being bit for bit below ~1e-3 (1e-4: 0.14% of values a level
# apart) and gaussian and speckle noise fall below float32's resolution of x / 255 (~1e-6). 0.01 is ten times
# the smallest severity measured within the published distances everywhere (1e-3), a margin for other machines'
# float rounding, and a twenty-fifth of CCC's 0.25 grid step: finer than any severity a walk or table uses.
MIN_FRACTIONAL_SEVERITY = 0.01
MAX_SEED = 2**32 - 1  # corruption seeds: 0 to np.random.seed's top (`check_seed`)

# zoom_blur's rows are np.arange(start, stop, step): CCC interpolates the triplets.
_ZOOM = {"cifar": tuple((1, hi, 0.01) for hi in (1.06, 1.11, 1.16, 1.21, 1.26)),
         "imagenet": ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03))}

TABLES = {
    # CIFAR-10-C, severity 1..5 (make_cifar_c.py).
    "cifar": {
        "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
        "shot_noise": (500, 250, 100, 75, 50),
        "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
        "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),
        "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
        "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),  # sigma, shift, iters
        "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),  # radius, alias blur
        "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),  # radius, sigma
        "zoom_blur": tuple(np.arange(*r) for r in _ZOOM["cifar"]),
        "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),  # strength, wibble decay
        "frost": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),  # image weight, frost weight
        "snow": ((0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9), (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
                 (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85), (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)),
        "spatter": ((0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0), (0.65, 0.3, 1, 0.69, 0.5, 0),
                    (0.65, 0.1, 0.7, 0.69, 0.6, 1), (0.65, 0.1, 0.5, 0.68, 0.6, 1)),
        "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
        "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),
        "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),
        "jpeg_compression": (80, 65, 58, 50, 40),
        "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
        "elastic_transform": tuple((SIZE * a, SIZE * s, SIZE * f) for a, s, f in
                                   ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05),
                                    (0.1, 0.03, 0.03))),  # elastic alpha, elastic sigma, affine jitter
    },
    # ImageNet-C, severity 1..5 (make_imagenet_c.py).
    "imagenet": {
        "gaussian_noise": (.08, .12, 0.18, 0.26, 0.38),
        "shot_noise": (60, 25, 12, 5, 3),
        "impulse_noise": (.03, .06, .09, 0.17, 0.27),
        "speckle_noise": (.15, .2, 0.35, 0.45, 0.6),
        "gaussian_blur": (1, 2, 3, 4, 6),
        "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),
        "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
        "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),
        "zoom_blur": tuple(np.arange(*r) for r in _ZOOM["imagenet"]),
        "fog": ((1.5, 2), (2, 2), (2.5, 1.7), (2.5, 1.5), (3, 1.4)),
        "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
        "snow": ((0.1, 0.3, 3, 0.5, 10, 4, 0.8), (0.2, 0.3, 2, 0.5, 12, 4, 0.7), (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
                 (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65), (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55)),
        "spatter": ((0.65, 0.3, 4, 0.69, 0.6, 0), (0.65, 0.3, 3, 0.68, 0.6, 0), (0.65, 0.3, 2, 0.68, 0.5, 0),
                    (0.65, 0.3, 1, 0.65, 1.5, 1), (0.67, 0.4, 1, 0.65, 1.5, 1)),
        "contrast": (0.4, .3, .2, .1, .05),
        "brightness": (.1, .2, .3, .4, .5),
        "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
        "jpeg_compression": (25, 18, 15, 10, 7),
        "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
        # "244 should have been 224, but ultimately nothing is incorrect" (the release's comment).
        "elastic_transform": ((244 * 2, 244 * 0.7, 244 * 0.1), (244 * 2, 244 * 0.08, 244 * 0.2),
                              (244 * 0.05, 244 * 0.01, 244 * 0.02), (244 * 0.07, 244 * 0.01, 244 * 0.02),
                              (244 * 0.12, 244 * 0.01, 244 * 0.02)),
    },
}

# Row 0 of the fractional tables (CCC's make_imagenet_c.py). CCC has the 15 benchmark corruptions at ImageNet
# strength; the other rows are ours, made the same way: the parameters of "no corruption" where they exist
# (noise 0, weight 1, quality 85 as CCC's JPEG), otherwise row 1 with the effect switched off (snow's flake
# threshold and image weight 1, spatter's intensity 0). shot_noise and zoom_blur interpolate other quantities
# (`params`): 1 / photons, and the (start, stop, step) of the zoom factors.
ZERO_ROWS = {
    "cifar": {
        "gaussian_noise": 0.0, "shot_noise": 0.0, "impulse_noise": 0.0, "speckle_noise": 0.0, "gaussian_blur": 0.0,
        "glass_blur": (0.0, 0.0, 0.0), "defocus_blur": (0.0, 0.0), "motion_blur": (0.0, 0.0),
        "zoom_blur": (1.0, 1.0, 0.01), "fog": (0.0, 3.0), "frost": (1.0, 0.0),
        "snow": (0.1, 0.2, 1, 1.0, 8, 3, 1.0), "spatter": (0.62, 0.1, 0.7, 0.7, 0.0, 0), "contrast": 1.0,
        "brightness": 0.0, "saturate": (1.0, 0.0), "jpeg_compression": 85, "pixelate": 1.0,
        "elastic_transform": (0.0, 0.0, 0.0),
    },
}
# ImageNet's rows 0 differ from CIFAR's where row 1 does: fog's decay, snow's and spatter's shapes, elastic.
ZERO_ROWS["imagenet"] = dict(ZERO_ROWS["cifar"], fog=(0.0, 2.0), snow=(0.1, 0.3, 3, 1.0, 10, 4, 1.0),
                             spatter=(0.65, 0.3, 4, 0.69, 0.0, 0), elastic_transform=(0, 999, 0))


def _severity(severity) -> float:
  """``severity`` as a float in [0, 5] (nan and inf refused), or a one-line `UserError`."""
  try:
    s = float(severity)
  except (TypeError, ValueError):
    raise UserError(f"severity '{severity}': expected a number from 0 to {MAX_SEVERITY}") from None
  if not 0 <= s <= MAX_SEVERITY:  # also rejects nan
    raise UserError(f"severity {severity}: expected a number from 0 to {MAX_SEVERITY} (above 0: at least "
                    f"{MIN_FRACTIONAL_SEVERITY:g})")
  return s


def _check(corruption: str, severity: float, strength: str) -> float:
  if strength not in STRENGTHS:
    raise UserError(f"corruption strength '{strength}': expected one of {', '.join(STRENGTHS)}")
  if corruption not in ALL:
    raise UserError(f"unknown corruption '{corruption}': expected one of {', '.join(ALL)}")
  s = _severity(severity)
  if 0 < s < MIN_FRACTIONAL_SEVERITY:
    raise UserError(f"severity {s:g}: expected 0 (the clean image) or a number from {MIN_FRACTIONAL_SEVERITY:g} "
                    f"to {MAX_SEVERITY}")
  return s


def check_fractional_severity(severity, flag: str = "--severity") -> float:
  """A generated-data severity from the user (``--severity`` with ``--clean-data`` or the built-in benchmark): a
  number in [`MIN_FRACTIONAL_SEVERITY`, 5], fractions allowed, as a float; anything else (below the minimum,
  0, negative, above 5, nan, inf, not a number) is a one-line `UserError` naming ``flag``. Severity 0 (the
  clean image) stays open to CCC's walks through `params` and `corrupt`, not to the flag."""
  ok = isinstance(severity, (int, float, np.integer, np.floating)) and not isinstance(severity, (bool, np.bool_))
  s = float(severity) if ok else float("nan")
  if not (math.isfinite(s) and MIN_FRACTIONAL_SEVERITY <= s <= MAX_SEVERITY):
    raise UserError(f"{flag}: expected a number in [{MIN_FRACTIONAL_SEVERITY:g}, {MAX_SEVERITY}], got {severity!r}")
  return s


def check_seed(seed, flag: str = "--corruption-seed") -> int:
  """A corruption seed from the user: an integer in [0, `MAX_SEED`], returned as an int; anything else (negative,
  larger, a bool, a float, a string) is a one-line `UserError` naming ``flag``. numpy's ``SeedSequence`` (which
  `image_seed` and CCC's plan Generators are built on) refuses negative entropy with a ``ValueError``; the top is
  ``np.random.seed``'s own range (2**32 - 1), which every seed the releases and the TTA code bases use fits in."""
  ok = isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_))
  if not (ok and 0 <= int(seed) <= MAX_SEED):
    raise UserError(f"{flag}: expected an integer from 0 to {MAX_SEED}, got {seed!r}")
  return int(seed)


def _anchor(corruption: str, strength: str, k: int) -> np.ndarray:
  """Row ``k`` (0..5) in the space CCC interpolates it in."""
  if corruption == "zoom_blur":
    row = ZERO_ROWS[strength][corruption] if k == 0 else _ZOOM[strength][k - 1]
  elif corruption == "shot_noise":  # photons per unit: CCC interpolates their reciprocal
    row = 0.0 if k == 0 else 1.0 / TABLES[strength][corruption][k - 1]
  else:
    row = ZERO_ROWS[strength][corruption] if k == 0 else TABLES[strength][corruption][k - 1]
  return np.asarray(row, np.float64)


def params(corruption: str, severity: float, strength: str = "cifar") -> Any:
  """The table row of ``corruption`` at ``severity`` in [0, 5], fractions allowed (CCC's convention).

  Integer severities 1..5 return the table row itself. Others interpolate linearly between the rows
  ``floor(severity)`` and ``ceil(severity)`` (row 0: `ZERO_ROWS`), as CCC's ``interp1d`` does, then:
  shot noise interpolates ``1 / photons`` and inverts it (9999 at 0, CCC's value); zoom blur interpolates
  ``(start, stop, step)`` and takes ``np.arange`` of it; glass blur's shift is raised to 1 then rounded, and
  its iterations rounded (Python's ``round``, half to even, as CCC); JPEG's quality is rounded; spatter's
  mode (0 water, 1 mud; not in CCC) is rounded, so 3.5 is still water. Motion blur and snow keep a fractional
  radius: their functions widen the kernel to ``2 * ceil(radius) + 1`` taps, as ImageMagick does.

  Severities in (0, `MIN_FRACTIONAL_SEVERITY`) are refused (`UserError`): no path computes them faithfully.
  """
  return _row(corruption, _check(corruption, severity, strength), strength)


def _row(corruption: str, s: float, strength: str) -> Any:
  """`params` without its range checks, for a float ``s`` in [0, 5]: what the tables give below the minimum
  (``benchmarks/device_small_severity.py`` measures there why it is the minimum)."""
  if s.is_integer() and s >= 1:
    return TABLES[strength][corruption][int(s) - 1]
  lo = int(math.floor(s))
  hi = min(lo + 1, MAX_SEVERITY)
  a, b = _anchor(corruption, strength, lo), _anchor(corruption, strength, hi)
  v = a + (b - a) * (s - lo)  # interp1d's form: slope times the offset from the lower row
  if corruption == "shot_noise":
    return 1.0 / float(v) if v != 0 else 9999
  if corruption == "zoom_blur":
    return np.arange(v[0], v[1], v[2])
  if corruption == "glass_blur":
    return float(v[0]), round(max(float(v[1]), 1.0)), round(float(v[2]))
  if corruption == "jpeg_compression":
    return round(float(v))
  if corruption == "spatter":
    return tuple(float(t) for t in v[:5]) + (round(float(v[5])),)
  return float(v) if v.ndim == 0 else tuple(float(t) for t in v)


def _lib():
  from imagecorruptions import corruptions as lib

  return lib


def _gaussian(x: np.ndarray, sigma: float, **kw) -> np.ndarray:
  from skimage.filters import gaussian

  return gaussian(x, sigma=sigma, **kw)


@functools.lru_cache(maxsize=None)
def _zoom_matrix(h: int, factor: float) -> np.ndarray:
  """[H, H] linear map of `_clipped_zoom` along one axis.

  scipy's ``zoom(order=1)`` (the original's resampler) maps output pixel o of
  ``n_out = round(n_in * factor)`` to input coordinate ``o * (n_in - 1) / (n_out - 1)``
  and interpolates linearly. Written as a matrix, it runs on a whole batch as
  two batched matmuls instead of one scipy call per image and zoom factor.
  """
  ch = int(np.ceil(h / factor))
  top = (h - ch) // 2
  n_out = int(round(ch * factor))
  coords = np.arange(n_out) * (ch - 1) / max(n_out - 1, 1)
  lo = np.clip(np.floor(coords).astype(int), 0, ch - 1)
  hi = np.minimum(lo + 1, ch - 1)
  w = coords - lo
  m = np.zeros((n_out, h))
  m[np.arange(n_out), top + lo] += 1 - w
  m[np.arange(n_out), top + hi] += w
  trim = (n_out - h) // 2
  return m[trim:trim + h]


def _clipped_zoom(img: np.ndarray, factor: float) -> np.ndarray:
  """Zooms the centre of square [..., H, W, C] images by ``factor`` and trims back to H, centred."""
  m = _zoom_matrix(img.shape[-3], float(factor))
  chw = np.moveaxis(img, -1, -3)  # [..., C, H, W]: batched BLAS matmuls on the last two axes
  return np.moveaxis(m @ chw @ m.T, -3, -1).astype(img.dtype)


def _scipy_clipped_zoom(img: np.ndarray, factor: float) -> np.ndarray:
  """The release's ``clipped_zoom`` (scipy ``zoom``, order 1) of one [H, W, C] image, for any H and W: zooms
  the centre ``ceil(side / factor)`` crop and trims the result back to H x W, centred."""
  from scipy.ndimage import zoom

  h, w = img.shape[:2]
  ch, cw = int(np.ceil(h / factor)), int(np.ceil(w / factor))
  top, left = (h - ch) // 2, (w - cw) // 2
  img = zoom(img[top:top + ch, left:left + cw], (factor, factor, 1), order=1)
  th, tw = (img.shape[0] - h) // 2, (img.shape[1] - w) // 2
  return img[th:th + h, tw:tw + w]


@functools.lru_cache(maxsize=None)
def frost_textures(scale: float = 0.2) -> tuple[np.ndarray, ...]:
  """The library's frost photos (BGR), resized by ``scale`` (CIFAR-10-C: 0.2; ImageNet-C: 1, the photos
  themselves). Read once per process: re-reading them for every image made frost the slowest corruption."""
  import cv2

  out = []
  for name in ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"):
    with importlib.resources.as_file(importlib.resources.files("imagecorruptions") / "frost" / name) as p:
      img = cv2.imread(str(p))
    out.append(img if scale == 1 else cv2.resize(img, (0, 0), fx=scale, fy=scale))
  return tuple(out)


def _per_channel(x: np.ndarray, fn) -> np.ndarray:
  return np.stack([fn(np.ascontiguousarray(x[..., d])) for d in range(x.shape[-1])], axis=-1)


def gaussian_noise(x, c):
  x = x / 255.0
  return np.clip(x + np.random.normal(size=x.shape, scale=c), 0, 1) * 255


def shot_noise(x, c):
  return np.clip(np.random.poisson(x / 255.0 * c) / c, 0, 1) * 255


def impulse_noise(x, c):
  from skimage.util import random_noise

  return np.clip(random_noise(x / 255.0, mode="s&p", rng=int(np.random.randint(2**31)), amount=c), 0, 1) * 255


def speckle_noise(x, c):
  x = x / 255.0
  return np.clip(x + x * np.random.normal(size=x.shape, scale=c), 0, 1) * 255


def gaussian_blur(x, c):
  return np.clip(_gaussian(x / 255.0, c, channel_axis=-1), 0, 1) * 255


def glass_blur(x, c):
  sigma, delta, iters = float(c[0]), int(c[1]), int(c[2])  # one numba specialization for every row
  x = np.uint8(_gaussian(x / 255.0, sigma, channel_axis=-1) * 255)
  # Local pixel swaps, loop bounds from the image size (the releases': 32 - delta, 224 - delta), by the
  # library's numba kernel.
  x = _lib()._shuffle_pixels_njit_glass_blur(x.shape[0], x.shape[1], x, (sigma, delta, iters),
                                              int(np.random.randint(2**31)))
  return np.clip(_gaussian(x / 255.0, sigma, channel_axis=-1), 0, 1) * 255


def defocus_blur(x, c):
  import cv2

  kernel = _lib().disk(radius=c[0], alias_blur=c[1])
  return np.clip(_per_channel(x / 255.0, lambda ch: cv2.filter2D(ch, -1, kernel)), 0, 1) * 255


def _motion_blur(x: np.ndarray, radius: float, sigma: float, angle: float) -> np.ndarray:
  """The package's numpy motion blur; a fractional radius gets ImageMagick's ``2 * ceil(radius) + 1`` taps."""
  return _lib()._motion_blur(x, radius=math.ceil(radius), sigma=sigma, angle=angle)


def motion_blur(x, c):
  return np.clip(_motion_blur(x, c[0], c[1], angle=np.random.uniform(-45, 45)), 0, 255)


def _zoom_blur(x: np.ndarray, c, clipped_zoom) -> np.ndarray:
  x = (x / 255.0).astype(np.float32)
  out = np.zeros_like(x)
  for factor in c:
    out += clipped_zoom(x, factor)
  return np.clip((x + out) / (len(c) + 1), 0, 1) * 255


def zoom_blur(x, c):
  """Deterministic, and shape-generic over square images: `corrupt_batch` runs it on many images in one go."""
  return _zoom_blur(x, c, _clipped_zoom)


def zoom_blur_release(x, c):
  """`zoom_blur` with the release's scipy zoom: ImageNet-C's bit for bit, one image of any shape at a time."""
  return _zoom_blur(x, c, _scipy_clipped_zoom)


def _next_power_of_2(n: int) -> int:
  return 1 << (int(n) - 1).bit_length()


def fog(x, c):
  h, w = x.shape[:2]
  x = x / 255.0
  max_val = x.max()
  plasma = _lib().plasma_fractal(mapsize=_next_power_of_2(max(h, w)), wibbledecay=c[1])
  x = x + c[0] * plasma[:h, :w][..., None]
  return np.clip(x * max_val / (max_val + c[0]), 0, 1) * 255


def _frost(x, c, scale):
  tex = frost_textures(scale)[np.random.randint(5)]  # both releases draw from the first five photos
  h, w = x.shape[:2]
  i, j = np.random.randint(0, tex.shape[0] - h), np.random.randint(0, tex.shape[1] - w)
  return np.clip(c[0] * x + c[1] * tex[i:i + h, j:j + w][..., ::-1], 0, 255)


def frost(x, c):
  return _frost(x, c, 0.2)


def frost_release(x, c):
  """ImageNet-C's frost: crops of the photos at their own size."""
  return _frost(x, c, 1)


def _snow(x, c, layer_to_8_bits, clipped_zoom):
  import cv2

  x = x.astype(np.float32) / 255.0
  layer = np.random.normal(size=x.shape[:2], loc=c[0], scale=c[1])
  layer = clipped_zoom(layer[..., None], c[2])
  layer[layer < c[3]] = 0
  layer = layer_to_8_bits(np.clip(layer[..., 0], 0, 1) * 255) / 255.0  # the releases went through an 8-bit PNG
  layer = _motion_blur(layer, c[4], c[5], angle=np.random.uniform(-135, -45))
  layer = (np.round(np.clip(layer, 0, 1) * 255) / 255.0)[..., None]
  grey = cv2.cvtColor(x, cv2.COLOR_RGB2GRAY)[..., None]
  x = c[6] * x + (1 - c[6]) * np.maximum(x, grey * 1.5 + 0.5)
  return np.clip(x + layer + np.rot90(layer, k=2), 0, 1) * 255


def snow(x, c):
  return _snow(x, c, np.round, _clipped_zoom)


def snow_release(x, c):
  """ImageNet-C's snow: the flake layer zoomed with scipy and truncated to 8 bits (``astype(np.uint8)``), as
  the release wrote it to a PNG for ImageMagick; the motion blur is the package's numpy one."""
  return _snow(x, c, np.trunc, _scipy_clipped_zoom)


def spatter(x, c):
  import cv2

  x = x.astype(np.float32) / 255.0
  liquid = _gaussian(np.random.normal(size=x.shape[:2], loc=c[0], scale=c[1]), c[2])
  liquid[liquid < c[3]] = 0
  if c[5] == 0:  # water: pale turquoise drops with shaded rims
    liquid = (liquid * 255).astype(np.uint8)
    dist = cv2.distanceTransform(255 - cv2.Canny(liquid, 50, 150), cv2.DIST_L2, 5)
    _, dist = cv2.threshold(dist, 20, 20, cv2.THRESH_TRUNC)
    dist = cv2.equalizeHist(cv2.blur(dist, (3, 3)).astype(np.uint8))
    dist = cv2.filter2D(dist, cv2.CV_8U, np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]]))
    m = (liquid * cv2.blur(dist, (3, 3)).astype(np.float32))[..., None]
    m = m / max(float(m.max()), 1e-12) * c[4]
    color = np.array([175, 238, 238], np.float32) / 255.0
    return np.clip(x + m * color, 0, 1) * 255
  m = _gaussian(np.where(liquid > c[3], 1, 0).astype(np.float32), c[4])  # mud: brown blotches
  m[m < 0.8] = 0
  color = np.array([63, 42, 20], np.float32) / 255.0
  return np.clip(x * (1 - m[..., None]) + color * m[..., None], 0, 1) * 255


def contrast(x, c):
  x = x / 255.0
  means = x.mean(axis=(0, 1), keepdims=True)
  return np.clip((x - means) * c + means, 0, 1) * 255


def _hsv(x, channel, fn):
  from skimage import color

  hsv = color.rgb2hsv(x / 255.0)
  hsv[..., channel] = np.clip(fn(hsv[..., channel]), 0, 1)
  return np.clip(color.hsv2rgb(hsv), 0, 1) * 255


def brightness(x, c):
  return _hsv(x, 2, lambda v: v + c)


def saturate(x, c):
  return _hsv(x, 1, lambda s: s * c[0] + c[1])


def jpeg_compression(x, c):
  buf = io.BytesIO()
  Image.fromarray(x).save(buf, "JPEG", quality=c)
  buf.seek(0)
  return np.asarray(Image.open(buf).convert("RGB"))


def pixelate(x, c):
  h, w = x.shape[:2]
  small = Image.fromarray(x).resize((int(w * c), int(h * c)), Image.BOX)
  return np.asarray(small.resize((w, h), Image.BOX))


def elastic_transform(x, c):
  import cv2
  from scipy.ndimage import map_coordinates

  img = x.astype(np.float32) / 255.0
  shape = img.shape
  # A random affine jitter of three anchor points, then a smooth random displacement field.
  centre = np.float32(shape[:2]) // 2
  side = min(shape[:2]) // 3
  pts1 = np.float32([centre + side, [centre[0] + side, centre[1] - side], centre - side])
  pts2 = pts1 + np.random.uniform(-c[2], c[2], size=pts1.shape).astype(np.float32)
  img = cv2.warpAffine(img, cv2.getAffineTransform(pts1, pts2), shape[:2][::-1], borderMode=cv2.BORDER_REFLECT_101)
  dx = (_gaussian(np.random.uniform(-1, 1, size=shape[:2]), c[1], mode="reflect", truncate=3) * c[0])
  dy = (_gaussian(np.random.uniform(-1, 1, size=shape[:2]), c[1], mode="reflect", truncate=3) * c[0])
  dx, dy = dx.astype(np.float32)[..., None], dy.astype(np.float32)[..., None]
  xx, yy, zz = np.meshgrid(np.arange(shape[1]), np.arange(shape[0]), np.arange(shape[2]))
  idx = np.reshape(yy + dy, (-1, 1)), np.reshape(xx + dx, (-1, 1)), np.reshape(zz, (-1, 1))
  return np.clip(map_coordinates(img, idx, order=1, mode="reflect").reshape(shape), 0, 1) * 255


_CIFAR_FUNCTIONS = {f.__name__: f for f in (
    gaussian_noise, shot_noise, impulse_noise, speckle_noise, gaussian_blur, glass_blur, defocus_blur, motion_blur,
    zoom_blur, fog, frost, snow, spatter, contrast, brightness, saturate, jpeg_compression, pixelate,
    elastic_transform)}
FUNCTIONS = {"cifar": _CIFAR_FUNCTIONS,
             "imagenet": dict(_CIFAR_FUNCTIONS, zoom_blur=zoom_blur_release, frost=frost_release, snow=snow_release)}
assert all(set(FUNCTIONS[s]) == set(ALL) == set(TABLES[s]) == set(ZERO_ROWS[s]) for s in STRENGTHS)

# The corruptions that draw no random numbers: no seeding (and no lock) needed.
DETERMINISTIC = ("gaussian_blur", "defocus_blur", "zoom_blur", "contrast", "brightness", "saturate",
                 "jpeg_compression", "pixelate")
BATCHED = ("zoom_blur",)  # at CIFAR strength, vectorized over images by `corrupt_batch`

# numpy's global generator is one per process, and the loader decodes in threads: seeding it and drawing from
# it must not interleave with another image's (`corruptions_bar` holds the same lock).
RNG_LOCK = threading.Lock()


def _severity_code(severity: float) -> int:
  """Integer severities as themselves (the built-in cache's seeds); a fraction as its float64 bits, an
  integer above 2**52 that no integer severity takes."""
  s = float(severity)
  return int(s) if s.is_integer() else int(np.float64(s).view(np.uint64))


def image_seed(seed: int, corruption: str, severity: float, index: int) -> int:
  """The numpy seed of one corrupted image (stable across processes and Python versions); ``seed`` as
  `check_seed` takes it (a `UserError` otherwise)."""
  entropy = [check_seed(seed, "corruption seed"), zlib.crc32(corruption.encode()), _severity_code(severity), index]
  return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def corrupt(image: np.ndarray, corruption: str, severity: float, seed: int, index: int,
            strength: str = "cifar") -> np.ndarray:
  """One HWC uint8 image -> its corrupted uint8 version (truncated to uint8 like the releases).

  ``severity`` in [0, 5], fractions allowed (`params`); 0 returns the image unchanged, as CCC's generator.
  ``index`` keys the image's random draws (`image_seed`): the test-set index for the built-in benchmark, a
  key of the image's name for the generated ImageNet-C (`pcsr_jax.data.generators.generated.image_key`).
  """
  c = params(corruption, severity, strength)
  return _corrupt_row(image, corruption, severity, c, seed, index, strength)


def _corrupt_row(image: np.ndarray, corruption: str, severity: float, c: Any, seed: int, index: int,
                 strength: str) -> np.ndarray:
  """`corrupt` with the table row ``c`` given, unchecked (the benchmark's way below the minimum severity)."""
  x = np.asarray(image, np.uint8)
  if float(severity) == 0:
    return x.copy()
  fn = FUNCTIONS[strength][corruption]
  if corruption in DETERMINISTIC:
    return np.uint8(np.asarray(fn(x, c)))
  with RNG_LOCK, warnings.catch_warnings():
    warnings.simplefilter("ignore")
    np.random.seed(image_seed(seed, corruption, severity, index))
    out = fn(x, c)
  return np.uint8(np.asarray(out))


def corrupt_batch(images: np.ndarray, corruption: str, severity: float, seed: int, start: int,
                  strength: str = "cifar") -> np.ndarray:
  """`corrupt` over ``images`` whose test-set indices start at ``start``."""
  if corruption in BATCHED and strength == "cifar" and float(severity) != 0:
    return np.uint8(FUNCTIONS[strength][corruption](np.asarray(images, np.uint8),
                                                    params(corruption, severity, strength)))
  return np.stack([corrupt(img, corruption, severity, seed, start + i, strength) for i, img in enumerate(images)])
