"""ImageNet-C-bar's 10 corruptions (Mintun et al. 2021), vectorized over pixels.

The official code (``facebookresearch/augmentation-corruption:imagenet_c_bar/corrupt.py``) evaluates every
corruption as a Python function per pixel: up to seconds per 224 px image. These are the same
computations as whole-array numpy operations, equal bit for bit to the official code run on this NumPy
(`benchmarks/torch_methods/imagenet_c_bar.py` runs it; ``tests/test_corruptions_bar.py`` checks every
corruption). Measured for one 224 px image on one core of the (shared) development machine, official ->
ours: caustic_refraction 7.4 s -> 0.09 s, sparkles 8.1 s -> 0.08 s, perlin_noise 5.0 s -> 0.19 s,
plasma_noise 4.6 s -> 0.03 s, inverse_sparkles 1.2 s -> 0.02 s, brownish_noise 1.2 s -> 0.03 s,
blue_noise_sample 0.48 s -> 0.015 s, checkerboard_cutout 0.41 s -> 0.008 s, cocentric_sine_waves 0.33 s ->
0.014 s, single_frequency_greyscale 0.08 s -> 0.006 s (25x to 150x).

``FUNCTIONS[name](x, c)`` takes a square uint8 HxWx3 image (224 px for ImageNet-C-bar; the official code is
written for any square ``im_size`` and so are these) and ``c``, the csv level of one severity
(``TABLES[name][severity - 1]``, the official ``severity`` argument), and returns floats in 0..255 whose
``np.uint8`` truncation is the official output. Randomness comes from numpy's global generator, drawn in the
official order (``sample_parameters``, then the ``RandomState`` seeded from it); `corrupt` seeds it per image
from ``(seed, corruption, severity, image index)`` as `pcsr_jax.data.generators.corruptions.corrupt` does. The release
seeded once per dataset and generated in 10 workers, so its random draws cannot be reproduced image by image.

Departures from the official code:
- Scalar ``a ** k`` on numpy floats calls libm's ``pow``, while ``array ** k`` takes shortcuts for k = 2,
  0.5, -1 and, on AVX-512 CPUs, runs SIMD (SVML) code, both rounding differently (about 5% of values off by
  an ulp); `_pow` keeps libm's ``pow`` so results stay identical.
- perlin_noise: the official generator normalizes a random lattice gradient that can be (0, 0) (about 0.1 % of
  images), giving NaN pixels, which ``astype(np.uint8)`` turned into 0 on x86; we return 0 there explicitly.
- The release ran NumPy 1.19, whose value-based casting did caustic_refraction's bilinear blend of in-image
  pixels in float32 (float32 image times a numpy float64 weight); NumPy >= 2 does it in float64, as here, so
  a few of its pixels may differ from the release by one level (libm and SIMD math also differ across
  machines in the last bit).

The release then saved each image as a quality-85 JPEG (``make_imagenet_c_bar.py``); that step is the caller's.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
from scipy.fftpack import ifft2
from scipy.ndimage import gaussian_filter

from pcsr_jax.data.generators import corruptions
from pcsr_jax.data.generators.corruptions import image_seed
from pcsr_jax.errors import UserError

# imagenet_c_bar.csv, in its order (the order make_imagenet_c_bar.py generates them): severities 1..5.
TABLES = {
    "caustic_refraction": (2.35, 3.2, 4.9, 6.6, 9.15),
    "inverse_sparkles": (1.0, 2.0, 4.0, 9.0, 10.0),
    "sparkles": (1.0, 2.0, 3.0, 5.0, 6.0),
    "perlin_noise": (4.6, 5.2, 5.8, 7.6, 8.8),
    "blue_noise_sample": (0.8, 1.6, 2.4, 4.0, 5.6),
    "plasma_noise": (4.75, 7.0, 8.5, 9.25, 10.0),
    "checkerboard_cutout": (2.0, 3.0, 4.0, 5.0, 6.0),
    "cocentric_sine_waves": (3.0, 5.0, 8.0, 9.0, 10.0),
    "single_frequency_greyscale": (1.0, 1.5, 2.0, 4.5, 5.0),
    "brownish_noise": (1.0, 2.0, 3.0, 4.0, 5.0),
}
NAMES = tuple(TABLES)
SIZE = 224
_LUMA = (0.2126, 0.7152, 0.0722)


def _level(c: float, maxval: float) -> float:
  """The official ``float_parameter``: a csv level of 10 is ``maxval``."""
  return float(c) * maxval / 10.


def _pow(x: np.ndarray, e: float) -> np.ndarray:
  """``x ** e`` rounded as numpy's scalar power (libm ``pow``, NaN and inf included): ``float_power``'s
  float64 loop calls ``pow`` element by element on every CPU, where ``power``'s dispatches to SIMD code on
  AVX-512 (even with an exponent array, which only avoids the ``** 2`` shortcut)."""
  return np.float_power(np.asarray(x, np.float64), e)


def _size(x: np.ndarray) -> int:
  if x.ndim != 3 or x.shape[0] != x.shape[1] or x.shape[2] != 3:
    raise ValueError(f"ImageNet-C-bar corruptions take a square HxWx3 image, got shape {x.shape}")
  return x.shape[0]


def _grid(s: int) -> tuple[np.ndarray, np.ndarray]:
  """Integer row and column coordinates, [S, S] each: the official loops' ``y`` and ``x``."""
  y, x = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
  return y, x


@functools.lru_cache(maxsize=8)
def _radius(s: int) -> np.ndarray:
  """[S, S] distance of each pixel to the centre (S/2, S/2); the offsets are exact halves, so no rounding
  order issue."""
  y, x = _grid(s)
  dx, dy = x - s / 2, y - s / 2
  r = np.sqrt(dx * dx + dy * dy)
  r.flags.writeable = False
  return r


def _fourier_noise(random_state: np.random.RandomState, s: int, power: np.ndarray) -> np.ndarray:
  """Random phases with conjugate symmetry at radial amplitude ``power``, inverse FFT, unit std (the official
  ``gen_noise``; ``scipy.fftpack`` as there)."""
  phases = random_state.uniform(low=0, high=2 * np.pi, size=(s, s // 2))
  if s % 2 == 0:
    phases = np.concatenate((phases, phases[::-1, ::-1]), axis=1)
  else:
    centre = random_state.uniform(low=0, high=2 * np.pi, size=(s // 2, 1))
    centre = np.concatenate((centre, np.array([[0.0]]), centre[::-1, :]), axis=0)
    phases = np.concatenate((phases, centre, phases[::-1, ::-1]), axis=1)
  spectrum = power * (np.cos(phases) + np.sin(phases) * 1j)
  spectrum = np.roll(np.roll(spectrum, s // 2, axis=0), s // 2, axis=1)
  noise = np.real(ifft2(spectrum))
  return noise / np.std(noise)


def blue_noise_sample(x, c):
  """Black out pixels where blue noise (amplitude growing with frequency) is below a threshold."""
  s = _size(x)
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  noise = _fourier_noise(random_state, s, _radius(s))
  return np.clip(x * (noise > _level(c, 3.0) - 2.5)[..., None], 0, 255).astype(np.float64)


def brownish_noise(x, c):
  """Add brown-ish noise (amplitude 1 / (f^2 + 1)), drawn independently per channel."""
  s = _size(x)
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  power = 1 / (_pow(_radius(s), 2) + 1)
  noise = np.stack([_fourier_noise(random_state, s, power) for _ in range(3)], axis=2)
  return np.clip(x + _level(c, 64) * noise, 0, 255)


def _caustics(s: int, time: float, size: float) -> np.ndarray:
  """[S, S] caustic pattern (the official ``caustic_noise_kernel``), evaluated on all pixels at once."""
  y, x = _grid(s)
  p0 = (y / size % 1) * 6.28318530718 - 250
  p1 = (x / size % 1) * 6.28318530718 - 250
  i0, i1 = p0, p1
  c, inten = 1.0, 0.005
  for n in range(5):
    t = time * (1.0 - (3.5 / (n + 1)))
    i0, i1 = p0 + (np.cos(t - i0) + np.sin(t + i1)), p1 + (np.sin(t - i1) + np.cos(t + i0))
    length = np.sqrt(_pow(p0 / (np.sin(i0 + t) / inten), 2) + _pow(p1 / (np.cos(i1 + t) / inten), 2))
    c = c + 1.0 / length
  c = 1.17 - _pow(c / 5.0, 1.4)
  return np.clip(_pow(np.abs(c), 8.0), 0, 1)


def caustic_refraction(x, c):
  """Refract the image through a water surface whose height is a caustic pattern, and light it by the
  pattern's slope. Per pixel as the official ``luma_based_refract``: the luma slope of the blurred caustics
  gives a surface normal, Snell's law (eta 4) a displacement, rounded to 1e-3 px, and the image is read there
  bilinearly (outside reads black)."""
  s = _size(x)
  time = np.random.uniform(low=0.5, high=2.0)
  size = np.random.uniform(low=0.75, high=1.25) * s
  eta, lens_scale, lighting = 4.0, _level(c, 0.5 * s), _level(c, 2.0)
  pattern = _caustics(s, time, size)
  # Blurred as the official [S, S, 3] array (sigma 1 on the channel axis too: the channels can differ in the
  # last bit), then each pixel's luma, 0 outside the image.
  caustics = gaussian_filter(np.stack((pattern, pattern, pattern), axis=2), sigma=1)
  luma = np.pad(caustics[..., 0] * _LUMA[0] + caustics[..., 1] * _LUMA[1] + caustics[..., 2] * _LUMA[2], 1)
  north, south = luma[1:-1, :-2], luma[1:-1, 2:]  # the official offsets (0, -1) and (0, 1): columns
  west, east = luma[:-2, 1:-1], luma[2:, 1:-1]  # (-1, 0) and (1, 0): rows

  a, b = (east - west).ravel(), (south - north).ravel()
  normal = np.stack((a, b, np.ones_like(a)), axis=1)
  normal = normal / np.sqrt(normal[:, 0] * normal[:, 0] + normal[:, 1] * normal[:, 1]
                            + normal[:, 2] * normal[:, 2])[:, None]
  cos_in = normal[:, 2]  # dot((0, 0, 1), normal)
  bend = ~(np.abs(cos_in) >= 1.0 - 1e-3)  # else the ray passes straight
  n = normal[bend]
  out_angle = np.arcsin(np.sin(np.arccos(n[:, 2])) / eta)
  out_unrotated = np.stack((np.cos(out_angle), np.sin(out_angle), np.zeros_like(out_angle)), axis=1)
  spectator = np.cross(np.array([0.0, 0.0, 1.0]), n)
  spectator = spectator / np.sqrt(spectator[:, 0] * spectator[:, 0] + spectator[:, 1] * spectator[:, 1]
                                  + spectator[:, 2] * spectator[:, 2])[:, None]
  rotation = np.stack((n, np.cross(n, spectator), spectator), axis=1)
  ray = np.tile(np.array([0.0, 0.0, 1.0]), (s * s, 1))
  ray[bend] = (np.linalg.inv(rotation) @ out_unrotated[..., None])[..., 0]
  shift = np.round(ray * lens_scale, 3).reshape(s, s, 3)

  y, xx = _grid(s)
  p0, p1 = y + shift[..., 0], xx + shift[..., 1]
  l, u = np.floor(p0).astype(np.int64), np.floor(p1).astype(np.int64)
  img = x.astype(np.float32) / 255

  def at(r, q):
    inside = (r >= 0) & (r < s) & (q >= 0) & (q < s)
    v = img[np.clip(r, 0, s - 1), np.clip(q, 0, s - 1)].astype(np.float64)
    return np.where(inside[..., None], v, 0.0)

  wu, wd = ((1.0 - p1) + u)[..., None], ((1.0 - (u + 1)) + p1)[..., None]
  wl, wr = ((1.0 - p0) + l)[..., None], ((1.0 - (l + 1)) + p0)[..., None]
  al = at(l, u) * wu + at(l, u + 1) * wd
  ar = at(l + 1, u) * wu + at(l + 1, u + 1) * wd
  out = al * wl + ar * wr
  out = out + ((north - south) * lighting)[..., None]
  out = out + ((east - west) * lighting)[..., None]
  return np.clip(out, 0, 1) * 255


def checkerboard_cutout(x, c):
  """Grey out a random subset (fraction c/10) of the black squares of a rotated checkerboard."""
  s = _size(x)
  angle = np.random.uniform(low=0, high=2 * np.pi)
  scale = np.maximum(np.random.uniform(low=0.1, high=0.25) * s, 1)
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  grid = random_state.uniform(size=(int(4 * s // scale), int(4 * s // scale))) < _level(c, 1.0)
  y, xx = _grid(s)
  nx = (np.cos(angle) * y + np.sin(angle) * xx) / scale
  ny = (-np.sin(angle) * y + np.cos(angle) * xx) / scale
  # int() truncates toward zero; negative cells index from the end, as Python indexing does in the official.
  keep = (np.mod(nx, 2).astype(np.int64) != np.mod(ny, 2).astype(np.int64)) | ~grid[nx.astype(np.int64),
                                                                                      ny.astype(np.int64)]
  return np.where(keep[..., None], x, 128).astype(np.float64)


def cocentric_sine_waves(x, c):
  """Add concentric rings around a random centre, their radius modulated by a sine of the angle."""
  s = _size(x)
  offset = np.random.uniform(low=0, high=s, size=2)
  freq = np.random.uniform(low=0, high=10)
  amplitude = np.random.uniform(low=0, high=s / 10)
  ring_width = np.random.uniform(low=0, high=s / 10)
  intensity = _level(c, 128)
  y, xx = _grid(s)
  dx, dy = xx - offset[0], y - offset[1]  # the official names the column x and compares it with offset[0]
  angle = np.arctan2(dx, dy) * freq
  distance = ((np.sqrt(_pow(dx, 2) + _pow(dy, 2)) + np.sin(angle) * amplitude) % ring_width) / ring_width
  distance -= 1 / 2
  return np.clip(x + (intensity * distance)[..., None], 0, 255)


def _sparkle(value, centre, radius, ray_lengths, amount, colour, inverse):
  """One star of rays (the official ``kernel`` of Sparkles and InverseSparkles) over the whole image: the
  ray length interpolated at each pixel's angle over its squared distance, to the power (100-amount)/50,
  blends ``value`` [S, S, 3] float32 toward ``colour`` (or, ``inverse``, the colour toward the image)."""
  s = value.shape[0]
  y, xx = _grid(s)
  d0, d1 = y - centre[0], xx - centre[1]
  dist = np.sqrt(d0 * d0 + d1 * d1)
  rays = len(ray_lengths)
  d = (np.arctan2(d1, d0) + np.pi) / (2 * np.pi) * rays
  i = d.astype(np.int64)
  f = d - i
  if radius != 0:
    lengths = np.asarray(ray_lengths, np.float64)
    length = lengths[i % rays] + f * (lengths[(i + 1) % rays] - lengths[i % rays])
    g = _pow(_pow(length, 2) / (_pow(dist, 2) + 1e-4), (100 - amount) / 50.0)
    f = (1 - _pow(f - 0.5, 2)) * g
  f = np.clip(f, 0, 1)[..., None]
  return colour + f * (value - colour) if inverse else value + f * (colour - value)


def inverse_sparkles(x, c):
  """Fill the image with white except a random star of rays through which it shows."""
  s = _size(x)
  centre = np.random.uniform(low=0.25, high=0.75, size=2) * s
  radius = 0.25 * s
  amount = 100 - _level(c, 65)
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  rays = np.random.randint(low=50, high=200)
  ray_lengths = [radius + 25 / 100.0 * radius * random_state.randn() for _ in range(rays)]
  out = _sparkle(x.astype(np.float32), centre, radius, ray_lengths, amount, np.array([255, 255, 255]), True)
  return np.clip(out, 0, 255)


def sparkles(x, c):
  """Paint five white stars of 50-199 rays at random places, each over the previous result."""
  s = _size(x)
  centres = np.random.uniform(low=0, high=s, size=(5, 2))
  radii = np.array([_level(c, 0.1) for _ in range(5)]) * s
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  nrays = np.random.randint(low=50, high=200, size=5)
  out = x
  for centre, rays, radius in zip(centres, nrays, radii):
    ray_lengths = [max(1, radius + 25 / 100.0 * radius * random_state.randn()) for _ in range(rays)]
    out = _sparkle(out.astype(np.float32), centre, radius, ray_lengths, 50, np.array([255, 255, 255]), False)
  return np.clip(out, 0, 255)


def _perlin_tables(random_state: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
  """The official ``PerlinNoiseGenerator``'s permutation ``p`` [514] and unit gradients ``g`` [514, 2], drawn
  in its order (sequential calls, as there: 770 small draws take about a millisecond)."""
  b = 256
  p = np.arange(2 * b + 2)
  with np.errstate(invalid="ignore"):  # a (0, 0) gradient normalizes to NaN, as in the official code
    g = np.array([v / np.linalg.norm(v) for v in
                  ((random_state.randint(low=0, high=2**31, size=2) % (2 * b) - b) / b for _ in range(2 * b + 2))])
  for i in np.arange(b - 1, -1, -1):
    j = random_state.randint(low=0, high=2**31) % b
    p[i], p[j] = p[j], p[i]
  # The official copies entry by entry, so 512 and 513 repeat the already copied 256 and 257 (= 0 and 1).
  p[b:2 * b], p[2 * b:] = p[:b], p[:2]
  g[b:2 * b], g[2 * b:] = g[:b], g[:2]
  return p, g


def _perlin(p: np.ndarray, g: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """The official ``PerlinNoiseGenerator.noise`` on arrays of points (coordinates >= 0)."""
  b, n = 256, 16 * 256
  t = x + n
  bx0 = t.astype(np.int64) % b
  bx1 = (bx0 + 1) % b
  rx0 = t % 1
  rx1 = rx0 - 1.0
  t = y + n
  by0 = t.astype(np.int64) % b
  by1 = (by0 + 1) % b
  ry0 = t % 1
  ry1 = ry0 - 1.0
  i, j = p[bx0], p[bx1]
  b00, b10, b01, b11 = p[i + by0], p[j + by0], p[i + by1], p[j + by1]
  sx, sy = _pow(rx0, 2) * (3.0 - 2.0 * rx0), _pow(ry0, 2) * (3.0 - 2.0 * ry0)
  u = rx0 * g[b00, 0] + ry0 * g[b00, 1]
  v = rx1 * g[b10, 0] + ry0 * g[b10, 1]
  a = u + sx * (v - u)
  u = rx0 * g[b01, 0] + ry1 * g[b01, 1]
  v = rx1 * g[b11, 0] + ry1 * g[b11, 1]
  return 1.5 * (a + sy * ((u + sx * (v - u)) - a))


def perlin_noise(x, c):
  """Blend the image with grey Perlin turbulence (5 octaves, a 32 px lattice at 224 px)."""
  s = _size(x)
  m = np.array([[1, 0], [0, 1]]) / (32 * s / 224)
  random_state = np.random.RandomState(seed=np.random.randint(low=0, high=2**32))
  alpha = _level(c, 0.50)
  p, g = _perlin_tables(random_state)
  y, xx = _grid(s)
  n0, n1 = y * m[0, 0] + xx * m[1, 0], y * m[0, 1] + xx * m[1, 1]  # np.matmul([y, x], m)
  t, f = 0.0, 1.0
  with np.errstate(invalid="ignore"):
    while f <= 16.0:
      t = t + np.abs(_perlin(p, g, f * n0, f * n1)) / f
      f = f * 2
    noise = np.clip(0.5 * t + 0.5, 0, 1.0)[..., None]
    out = np.clip((1 - alpha) * x.astype(np.float32) + 255 * alpha * noise, 0, 255)
  return np.nan_to_num(out, nan=0.0)


def plasma_noise(x, c):
  """Blend the image with a colourful plasma: a few rounds of sine warps of the pixel grid."""
  s = _size(x)
  time = np.random.uniform(low=0.0, high=6 * np.pi)
  iterations = np.random.randint(low=4, high=7)
  sharpness = np.random.uniform(low=0.5, high=1.0)
  scale = np.random.uniform(low=0.075, high=0.2) * s
  intensity = _level(c, 64)
  y, xx = _grid(s)
  xx, y = xx / scale, y / scale
  i = np.array([1.0, 1.0, 1.0, 0.0])
  for _ in range(iterations):
    r0 = np.cos(y * i[0] - i[3] + time / i[1]) / i[2]
    r1 = np.sin(xx * i[0] - i[3] + time / i[1]) / i[2]
    r0, r1 = r0 + -r1 * 0.3, r1 + r0 * 0.3
    xx, y = xx + r0, y + r1
    i *= np.array([1.93, 1.15, (2.25 - sharpness), time * i[1]])
  noise = np.stack((np.sin(xx - time), np.sin((xx + y + np.sin(time)) * 0.5), np.sin(y + time)), axis=2)
  return np.clip((1 - intensity / 255) * x + intensity * noise, 0, 255)


def single_frequency_greyscale(x, c):
  """Add one grey plane wave of random frequency (up to pi per pixel) and phase."""
  s = _size(x)
  freq_mag = np.random.uniform(low=-np.pi, high=np.pi)
  freq_2 = np.random.uniform(low=-abs(freq_mag), high=abs(freq_mag))
  freq = np.array([freq_mag, freq_2])[np.random.permutation(2)]
  phase = np.random.uniform(low=0, high=2 * np.pi)
  y, xx = _grid(s)
  noise = np.sin(xx * freq[0] + y * freq[1] + phase)
  return np.clip(x + (_level(c, 196) * noise)[..., None], 0, 255)


FUNCTIONS = {f.__name__: f for f in (caustic_refraction, inverse_sparkles, sparkles, perlin_noise, blue_noise_sample,
                                     plasma_noise, checkerboard_cutout, cocentric_sine_waves,
                                     single_frequency_greyscale, brownish_noise)}
assert tuple(FUNCTIONS) == NAMES


def corrupt(image: np.ndarray, corruption: str, severity: int, seed: int, index: int) -> np.ndarray:
  """One square uint8 HxWx3 image -> its corrupted uint8 version (truncated, as the official
  ``astype(np.uint8)``), reproducible from ``(seed, corruption, severity, index)`` alone."""
  if corruption not in FUNCTIONS:
    raise UserError(f"unknown ImageNet-C-bar corruption '{corruption}' (known: {', '.join(NAMES)})")
  if severity not in (1, 2, 3, 4, 5):
    raise UserError(f"ImageNet-C-bar severity must be 1..5, got {severity}")
  # numpy's global generator is shared by the loader's threads: seed and draw under the one lock.
  with corruptions.RNG_LOCK, warnings.catch_warnings():
    warnings.simplefilter("ignore")
    np.random.seed(image_seed(seed, corruption, severity, index))
    out = FUNCTIONS[corruption](np.asarray(image, np.uint8), TABLES[corruption][severity - 1])
  return np.uint8(out)
