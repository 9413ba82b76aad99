"""The 19 Hendrycks corruptions at CIFAR-10-C strength, for 32x32 RGB images.

``imagecorruptions-imaug`` implements the corruptions with the ImageNet-C
(224 px) severity tables. At 32 px those erase the image -- severity-5 defocus,
glass, motion, elastic, fog and contrast leave the source model near chance --
so, as Hendrycks & Dietterich did for CIFAR-10-C, small images get their own
tables. The tables below are the published CIFAR-10-C ones (``make_cifar_c.py``
of the ``hendrycks/robustness`` repository); the functions are ours, built on
the library's primitives: its anti-aliased disk kernel, plasma fractal, the
numpy re-implementation of ImageMagick's motion blur (the original used Wand),
the numba pixel shuffle of glass blur, and its frost textures.

Randomness comes from numpy's global generator, which `corrupt` seeds for every
image from ``(seed, corruption, severity, image index)``: each image's
corruption is reproducible on its own, whatever else was generated before it.
"""

from __future__ import annotations

import functools
import importlib.resources
import io
import warnings
import zlib

import numpy as np
from PIL import Image

from pcsr_jax.data.imagenet import CORRUPTIONS, HELDOUT_CORRUPTIONS, SHORT_NAMES

# The 15 benchmark corruptions (ImageNet-C order), then the 4 held-out ones used for tuning.
BENCHMARK = CORRUPTIONS
HELDOUT = HELDOUT_CORRUPTIONS
ALL = BENCHMARK + HELDOUT
SHORT = SHORT_NAMES  # table headers
SIZE = 32

# CIFAR-10-C severity tables, severity 1..5 (make_cifar_c.py).
TABLES = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
    "shot_noise": (500, 250, 100, 75, 50),
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
    "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),  # sigma, max shift, iters
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),  # radius, alias blur
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),  # radius, sigma
    "zoom_blur": tuple(np.arange(1, hi, 0.01) for hi in (1.06, 1.11, 1.16, 1.21, 1.26)),
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
}


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


@functools.lru_cache(maxsize=None)
def frost_textures() -> tuple[np.ndarray, ...]:
  """The library's frost photos (BGR), shrunk to 0.2x as for CIFAR-10-C. Read once per process:
  re-reading them for every image made frost the slowest corruption by far."""
  import cv2

  out = []
  for name in ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"):
    with importlib.resources.as_file(importlib.resources.files("imagecorruptions") / "frost" / name) as p:
      img = cv2.imread(str(p))
    out.append(cv2.resize(img, (0, 0), fx=0.2, fy=0.2))
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
  sigma, delta, iters = c
  x = np.uint8(_gaussian(x / 255.0, sigma, channel_axis=-1) * 255)
  # Local pixel swaps (same loop bounds as CIFAR-10-C's), run by the library's numba kernel.
  x = _lib()._shuffle_pixels_njit_glass_blur(x.shape[0], x.shape[1], x, (sigma, delta, iters),
                                              int(np.random.randint(2**31)))
  return np.clip(_gaussian(x / 255.0, sigma, channel_axis=-1), 0, 1) * 255


def defocus_blur(x, c):
  import cv2

  kernel = _lib().disk(radius=c[0], alias_blur=c[1])
  return np.clip(_per_channel(x / 255.0, lambda ch: cv2.filter2D(ch, -1, kernel)), 0, 1) * 255


def motion_blur(x, c):
  return np.clip(_lib()._motion_blur(x, radius=c[0], sigma=c[1], angle=np.random.uniform(-45, 45)), 0, 255)


def zoom_blur(x, c):
  """Deterministic, and shape-generic: `corrupt_batch` runs it on many images in one go."""
  x = (x / 255.0).astype(np.float32)
  out = np.zeros_like(x)
  for factor in c:
    out += _clipped_zoom(x, factor)
  return np.clip((x + out) / (len(c) + 1), 0, 1) * 255


def fog(x, c):
  x = x / 255.0
  max_val = x.max()
  x = x + c[0] * _lib().plasma_fractal(mapsize=SIZE, wibbledecay=c[1])[:SIZE, :SIZE][..., None]
  return np.clip(x * max_val / (max_val + c[0]), 0, 1) * 255


def frost(x, c):
  tex = frost_textures()[np.random.randint(5)]  # CIFAR-10-C draws from the first five photos
  i, j = np.random.randint(0, tex.shape[0] - SIZE), np.random.randint(0, tex.shape[1] - SIZE)
  return np.clip(c[0] * x + c[1] * tex[i:i + SIZE, j:j + SIZE][..., ::-1], 0, 255)


def snow(x, c):
  import cv2

  x = x.astype(np.float32) / 255.0
  layer = np.random.normal(size=x.shape[:2], loc=c[0], scale=c[1])
  layer = _clipped_zoom(layer[..., None], c[2])
  layer[layer < c[3]] = 0
  layer = np.round(np.clip(layer[..., 0], 0, 1) * 255) / 255.0  # the original went through an 8-bit PNG
  layer = _lib()._motion_blur(layer, radius=c[4], sigma=c[5], angle=np.random.uniform(-135, -45))
  layer = (np.round(np.clip(layer, 0, 1) * 255) / 255.0)[..., None]
  grey = cv2.cvtColor(x, cv2.COLOR_RGB2GRAY)[..., None]
  x = c[6] * x + (1 - c[6]) * np.maximum(x, grey * 1.5 + 0.5)
  return np.clip(x + layer + np.rot90(layer, k=2), 0, 1) * 255


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
  small = Image.fromarray(x).resize((int(SIZE * c), int(SIZE * c)), Image.BOX)
  return np.asarray(small.resize((SIZE, SIZE), Image.BOX))


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


FUNCTIONS = {f.__name__: f for f in (gaussian_noise, shot_noise, impulse_noise, speckle_noise, gaussian_blur,
                                     glass_blur, defocus_blur, motion_blur, zoom_blur, fog, frost, snow, spatter,
                                     contrast, brightness, saturate, jpeg_compression, pixelate, elastic_transform)}
assert set(FUNCTIONS) == set(ALL) == set(TABLES)


DETERMINISTIC = ("zoom_blur",)  # no randomness: safe to vectorize over images


def image_seed(seed: int, corruption: str, severity: int, index: int) -> int:
  """The numpy seed of one corrupted image (stable across processes and Python versions)."""
  return int(np.random.SeedSequence([seed, zlib.crc32(corruption.encode()), severity, index]).generate_state(1)[0])


def corrupt(image: np.ndarray, corruption: str, severity: int, seed: int, index: int) -> np.ndarray:
  """One 32x32x3 uint8 image -> its corrupted uint8 version (truncated to uint8 like CIFAR-10-C)."""
  if corruption not in FUNCTIONS:
    raise ValueError(f"unknown corruption '{corruption}'")
  if not 1 <= severity <= 5:
    raise ValueError(f"severity must be 1..5, got {severity}")
  np.random.seed(image_seed(seed, corruption, severity, index))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = FUNCTIONS[corruption](np.asarray(image, np.uint8), TABLES[corruption][severity - 1])
  return np.uint8(np.asarray(out))


def corrupt_batch(images: np.ndarray, corruption: str, severity: int, seed: int, start: int) -> np.ndarray:
  """`corrupt` over ``images`` whose test-set indices start at ``start``."""
  if corruption in DETERMINISTIC:
    return np.uint8(FUNCTIONS[corruption](np.asarray(images, np.uint8), TABLES[corruption][severity - 1]))
  return np.stack([corrupt(img, corruption, severity, seed, start + i) for i, img in enumerate(images)])
