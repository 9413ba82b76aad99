"""ImageNet-C-bar's 10 corruptions as its official code runs them, pixel by pixel (numpy only, no torch).

Written from ``facebookresearch/augmentation-corruption:imagenet_c_bar/`` (``corrupt.py``, ``base.py``,
``utils/image.py``, ``utils/perlin_noise.py``, ``imagenet_c_bar.csv``, ``make_imagenet_c_bar.py``): one class per
corruption with the official ``name``, ``sample_parameters()`` drawing from numpy's global generator in the
official order, and ``transform(image, **params)`` evaluating the official per-pixel kernels in Python loops.
``Transform(severity, im_size)(image)`` samples, then transforms, as the official base class does; ``severity``
is the csv level (``CSV``), not 1..5. It is slow (seconds per 224 px image): it is the ground truth that
`pcsr_jax.data.generators.corruptions_bar` is tested against, on small images.

The arithmetic and the random draws are the official ones, operation for operation. Restructured only: the
kernels that the official repeats (the Fourier noise of BlueNoiseSample and BrownishNoise, the sparkle kernel
of Sparkles and InverseSparkles) are shared functions, the per-pixel loops go through ``Transform.pixels``,
and ``PerlinNoiseGenerator.s_curve`` is a staticmethod (the official calls it through the class).
The release ran NumPy 1.19; this runs on the installed NumPy (see `pcsr_jax.data.generators.corruptions_bar` for what
that changes).
"""

from __future__ import annotations

import numpy as np
from scipy.fftpack import ifft2
from scipy.ndimage import gaussian_filter

# imagenet_c_bar.csv: the five severity levels of each corruption, in the file's order.
CSV = {
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


def float_parameter(level, maxval):
  return float(level) * maxval / 10.


def bilinear_interpolation(image, point):
  """``utils/image.py``: neighbours outside the image read as black."""
  l, u = int(np.floor(point[0])), int(np.floor(point[1]))
  r, d = l + 1, u + 1

  def at(a, b):
    inside = 0 <= a < image.shape[0] and 0 <= b < image.shape[1]
    return image[a, b, :] if inside else np.array([0, 0, 0])

  al = at(l, u) * (1.0 - point[1] + u) + at(l, d) * (1.0 - d + point[1])
  ar = at(r, u) * (1.0 - point[1] + u) + at(r, d) * (1.0 - d + point[1])
  return al * (1.0 - point[0] + l) + ar * (1.0 - r + point[0])


class PerlinNoiseGenerator:
  """``utils/perlin_noise.py``: Perlin's 2-D gradient noise with 256 lattice gradients."""

  def __init__(self, random_state=None):
    self.rand = np.random if random_state is None else random_state
    B, N = 256, 16 * 256

    def normalize(arr):
      return arr / np.linalg.norm(arr)

    self.p = np.arange(2 * B + 2)
    self.g = np.array([normalize((random_state.randint(low=0, high=2**31, size=2) % (2 * B) - B) / B)
                       for _ in range(2 * B + 2)])
    for i in np.arange(B - 1, -1, -1):
      k = self.p[i]
      j = self.rand.randint(low=0, high=2**31) % B
      self.p[i] = self.p[j]
      self.p[j] = k
    for i in range(B + 2):
      self.p[B + i] = self.p[i]
      self.g[B + i, :] = self.g[i, :]
    self.B, self.N = B, N

  @staticmethod
  def s_curve(t):
    return t**2 * (3.0 - 2.0 * t)

  def noise(self, x, y):
    t = x + self.N
    bx0 = int(t) % self.B
    bx1 = (bx0 + 1) % self.B
    rx0 = t % 1
    rx1 = rx0 - 1.0
    t = y + self.N
    by0 = int(t) % self.B
    by1 = (by0 + 1) % self.B
    ry0 = t % 1
    ry1 = ry0 - 1.0
    i, j = self.p[bx0], self.p[bx1]
    b00, b10 = self.p[i + by0], self.p[j + by0]
    b01, b11 = self.p[i + by1], self.p[j + by1]
    sx, sy = self.s_curve(rx0), self.s_curve(ry0)
    u = rx0 * self.g[b00, 0] + ry0 * self.g[b00, 1]
    v = rx1 * self.g[b10, 0] + ry0 * self.g[b10, 1]
    a = u + sx * (v - u)
    u = rx0 * self.g[b01, 0] + ry1 * self.g[b01, 1]
    v = rx1 * self.g[b11, 0] + ry1 * self.g[b11, 1]
    b = u + sx * (v - u)
    return 1.5 * (a + sy * (b - a))

  def turbulence(self, x, y, octaves):
    t, f = 0.0, 1.0
    while f <= octaves:
      t += np.abs(self.noise(f * x, f * y)) / f
      f = f * 2
    return t


class Transform:
  """``base.Transform``: ``__call__`` samples the parameters, then applies them."""

  name = "abstract_transform"

  def __init__(self, severity, im_size):
    self.severity, self.im_size = severity, im_size

  def __call__(self, image):
    return self.transform(image, **self.sample_parameters())

  def pixels(self, fn):
    """The official ``np.array([[fn(y, x) for x in range(S)] for y in range(S)])``."""
    return np.array([[fn(y, x) for x in range(self.im_size)] for y in range(self.im_size)])


def _fourier_noise(self, random_state, power):
  """The shared body of ``BlueNoiseSample.transform`` and ``BrownishNoise.gen_noise``: random phases with
  conjugate symmetry, the given radial amplitude, an inverse FFT, unit standard deviation."""
  s = self.im_size
  phases = random_state.uniform(low=0, high=2 * np.pi, size=(s, s // 2))
  if s % 2 == 0:
    phases = np.concatenate((phases, phases[::-1, ::-1]), axis=1)
  else:
    center_freq = random_state.uniform(low=0, high=2 * np.pi, size=(s // 2, 1))
    center_freq = np.concatenate((center_freq, np.array([[0.0]]), center_freq[::-1, :]), axis=0)
    phases = np.concatenate((phases, center_freq, phases[::-1, ::-1]), axis=1)
  fourier_space_noise = power * (np.cos(phases) + np.sin(phases) * 1j)
  fourier_space_noise = np.roll(fourier_space_noise, s // 2, axis=0)
  fourier_space_noise = np.roll(fourier_space_noise, s // 2, axis=1)
  noise = np.real(ifft2(fourier_space_noise))
  return noise / np.std(noise)


class SingleFrequencyGreyscale(Transform):
  name = "single_frequency_greyscale"

  def sample_parameters(self):
    freq_mag = np.random.uniform(low=-np.pi, high=np.pi)
    freq_2 = np.random.uniform(low=-abs(freq_mag), high=abs(freq_mag))
    freq = np.array([freq_mag, freq_2])[np.random.permutation(2)]
    phase = np.random.uniform(low=0, high=2 * np.pi)
    return {"freq": freq, "phase": phase, "intensity": float_parameter(self.severity, 196)}

  def transform(self, image, freq, phase, intensity):
    noise = self.pixels(lambda y, x: np.sin(x * freq[0] + y * freq[1] + phase))
    noise = np.stack((noise, noise, noise), axis=2)
    return np.clip(image + intensity * noise, 0, 255).astype(np.uint8)


class CocentricSineWaves(Transform):
  name = "cocentric_sine_waves"

  def sample_parameters(self):
    offset = np.random.uniform(low=0, high=self.im_size, size=2)
    freq = np.random.uniform(low=0, high=10)
    amplitude = np.random.uniform(low=0, high=self.im_size / 10)
    ring_width = np.random.uniform(low=0, high=self.im_size / 10)
    intensity = [float_parameter(self.severity, 128) for _ in range(3)]
    return {"offset": offset, "freq": freq, "amplitude": amplitude, "ring_width": ring_width,
            "intensity": intensity}

  def transform(self, image, offset, freq, amplitude, ring_width, intensity):
    def calc_intensity(x, y, x0, y0):
      angle = np.arctan2(x - x0, y - y0) * freq
      distance = ((np.sqrt((x - x0)**2 + (y - y0)**2) + np.sin(angle) * amplitude) % ring_width) / ring_width
      distance -= 1 / 2
      return distance

    noise = self.pixels(lambda y, x: calc_intensity(x, y, offset[0], offset[1]))
    noise = np.stack((intensity[0] * noise, intensity[1] * noise, intensity[2] * noise), axis=2)
    return np.clip(image + noise, 0, 255).astype(np.uint8)


class PlasmaNoise(Transform):
  name = "plasma_noise"

  def sample_parameters(self):
    time = np.random.uniform(low=0.0, high=6 * np.pi)
    iterations = np.random.randint(low=4, high=7)
    sharpness = np.random.uniform(low=0.5, high=1.0)
    scale = np.random.uniform(low=0.075, high=0.2) * self.im_size
    return {"time": time, "iterations": iterations, "sharpness": sharpness, "scale": scale,
            "intensity": float_parameter(self.severity, 64)}

  def transform(self, image, time, iterations, sharpness, scale, intensity):
    def kernel(x, y):
      x /= scale
      y /= scale
      i = np.array([1.0, 1.0, 1.0, 0.0])
      for _ in range(iterations):
        r = np.array([np.cos(y * i[0] - i[3] + time / i[1]), np.sin(x * i[0] - i[3] + time / i[1])]) / i[2]
        r += np.array([-r[1], r[0]]) * 0.3
        x += r[0]
        y += r[1]
        i *= np.array([1.93, 1.15, (2.25 - sharpness), time * i[1]])
      return [np.sin(x - time), np.sin((x + y + np.sin(time)) * 0.5), np.sin(y + time)]

    noise = self.pixels(lambda y, x: kernel(x, y))
    return np.clip((1 - intensity / 255) * image + intensity * noise, 0, 255).astype(np.uint8)


class PerlinNoise(Transform):
  name = "perlin_noise"

  def sample_parameters(self):
    m = np.array([[1, 0], [0, 1]]) / (32 * self.im_size / 224)
    seed = np.random.randint(low=0, high=2**32)
    return {"m": m, "turbulence": 16.0, "seed": seed, "gain": 0.5, "bias": 0.5,
            "alpha": float_parameter(self.severity, 0.50)}

  def transform(self, image, m, turbulence, seed, gain, bias, alpha):
    gen = PerlinNoiseGenerator(np.random.RandomState(seed=seed))

    def kernel(point):
      npoint = np.matmul(point, m)
      f = (gen.turbulence(npoint[0], npoint[1], turbulence) if turbulence != 1.0
           else gen.noise(npoint[0], npoint[1]))
      f = gain * f + bias
      return np.clip(np.array([f, f, f]), 0, 1.0)

    noise = self.pixels(lambda y, x: kernel(np.array([y, x])))
    out = (1 - alpha) * image.astype(np.float32) + 255 * alpha * noise
    return np.clip(out, 0, 255).astype(np.uint8)


class BrownishNoise(Transform):
  name = "brownish_noise"

  def sample_parameters(self):
    seed = np.random.randint(low=0, high=2**32)
    return {"seed": seed, "intensity": float_parameter(self.severity, 64)}

  def gen_noise(self, random_state):
    center = self.im_size / 2
    power = self.pixels(lambda y, x: 1 / (np.linalg.norm(np.array([x, y]) - center)**2 + 1))
    return _fourier_noise(self, random_state, power)

  def transform(self, image, seed, intensity):
    random_state = np.random.RandomState(seed=seed)
    noise = np.stack([self.gen_noise(random_state) for _ in range(3)], axis=2)
    return np.clip(image + intensity * noise, 0, 255).astype(np.uint8)


class CheckerBoardCutOut(Transform):
  name = "checkerboard_cutout"

  def sample_parameters(self):
    angle = np.random.uniform(low=0, high=2 * np.pi)
    scales = np.maximum(np.random.uniform(low=0.1, high=0.25) * self.im_size, 1)
    seed = np.random.randint(low=0, high=2**32)
    return {"angle": angle, "scales": (scales, scales), "fraction": float_parameter(self.severity, 1.0),
            "seed": seed}

  def transform(self, image, scales, angle, fraction, seed):
    random_state = np.random.RandomState(seed=seed)
    grid = random_state.uniform(size=(int(4 * self.im_size // scales[0]), int(4 * self.im_size // scales[1])))
    grid = grid < fraction

    def keep(point):
      nx = (np.cos(angle) * point[0] + np.sin(angle) * point[1]) / scales[0]
      ny = (-np.sin(angle) * point[0] + np.cos(angle) * point[1]) / scales[1]
      return (int(nx % 2) != int(ny % 2)) or not grid[int(nx), int(ny)]

    out = self.pixels(lambda y, x: image[y, x, :] if keep([y, x]) else np.array([128, 128, 128]))
    return np.clip(out, 0, 255).astype(np.uint8)


def _sparkle(point, value, center, radius, ray_lengths, amount, color, inverse):
  """The per-pixel kernel of ``Sparkles`` (``inverse`` False) and ``InverseSparkles`` (True)."""
  rays = len(ray_lengths)
  dp = point - center
  dist = np.linalg.norm(dp)
  angle = np.arctan2(dp[1], dp[0])
  d = (angle + np.pi) / (2 * np.pi) * rays
  i = int(d)
  f = d - i
  if radius != 0:
    length = ray_lengths[i % rays] + f * (ray_lengths[(i + 1) % rays] - ray_lengths[i % rays])
    g = length**2 / (dist**2 + 1e-4)
    g = g ** ((100 - amount) / 50.0)
    f -= 0.5
    f = 1 - f**2
    f *= g
  f = np.clip(f, 0, 1)
  return color + f * (value - color) if inverse else value + f * (color - value)


class Sparkles(Transform):
  name = "sparkles"

  def sample_parameters(self):
    centers = np.random.uniform(low=0, high=self.im_size, size=(5, 2))
    radii = np.array([float_parameter(self.severity, 0.1) for _ in range(5)]) * self.im_size
    amounts = np.array([50 for _ in range(5)])
    seed = np.random.randint(low=0, high=2**32)
    nrays = np.random.randint(low=50, high=200, size=5)
    return {"centers": centers, "radii": radii, "color": np.array([255, 255, 255]), "randomness": 25,
            "seed": seed, "nrays": nrays, "amounts": amounts}

  def transform(self, image, centers, radii, nrays, amounts, color, randomness, seed):
    random_state = np.random.RandomState(seed=seed)
    for center, rays, amount, radius in zip(centers, nrays, amounts, radii):
      ray_lengths = [max(1, radius + randomness / 100.0 * radius * random_state.randn()) for _ in range(rays)]
      image = self.pixels(lambda y, x: _sparkle(np.array([y, x]), image[y, x, :].astype(np.float32), center,
                                                radius, ray_lengths, amount, color, inverse=False))
    return np.clip(image, 0, 255).astype(np.uint8)


class InverseSparkles(Transform):
  name = "inverse_sparkles"

  def sample_parameters(self):
    center = np.random.uniform(low=0.25, high=0.75, size=2) * self.im_size
    amount = 100 - float_parameter(self.severity, 65)
    seed = np.random.randint(low=0, high=2**32)
    rays = np.random.randint(low=50, high=200)
    return {"center": center, "radius": 0.25 * self.im_size, "color": np.array([255, 255, 255]),
            "randomness": 25, "seed": seed, "rays": rays, "amount": amount}

  def transform(self, image, center, radius, rays, amount, color, randomness, seed):
    random_state = np.random.RandomState(seed=seed)
    ray_lengths = [radius + randomness / 100.0 * radius * random_state.randn() for _ in range(rays)]
    out = self.pixels(lambda y, x: _sparkle(np.array([y, x]), image[y, x, :].astype(np.float32), center,
                                            radius, ray_lengths, amount, color, inverse=True))
    return np.clip(out, 0, 255).astype(np.uint8)


class BlueNoiseSample(Transform):
  name = "blue_noise_sample"

  def sample_parameters(self):
    seed = np.random.randint(low=0, high=2**32)
    return {"seed": seed, "threshold": float_parameter(self.severity, 3.0) - 2.5}

  def transform(self, image, seed, threshold):
    random_state = np.random.RandomState(seed=seed)
    center = self.im_size / 2
    power = self.pixels(lambda y, x: np.linalg.norm(np.array([x, y]) - center))
    noise = _fourier_noise(self, random_state, power)
    mask = noise > threshold
    out = image * mask.reshape(self.im_size, self.im_size, 1)
    return np.clip(out, 0, 255).astype(np.uint8)


class CausticRefraction(Transform):
  name = "caustic_refraction"

  def sample_parameters(self):
    time = np.random.uniform(low=0.5, high=2.0)
    size = np.random.uniform(low=0.75, high=1.25) * self.im_size
    return {"time": time, "size": size, "eta": 4.0, "lens_scale": float_parameter(self.severity, 0.5 * self.im_size),
            "lighting_amount": float_parameter(self.severity, 2.0), "softening": 1}

  def transform(self, image, time, size, eta, lens_scale, lighting_amount, softening):
    def caustic_noise_kernel(point):
      point = point / size
      p = (point % 1) * 6.28318530718 - 250
      i = p.copy()
      c = 1.0
      inten = 0.005
      for n in range(5):
        t = time * (1.0 - (3.5 / (n + 1)))
        i = p + np.array([np.cos(t - i[0]) + np.sin(t + i[1]), np.sin(t - i[1]) + np.cos(t + i[0])])
        length = np.sqrt((p[0] / (np.sin(i[0] + t) / inten))**2 + (p[1] / (np.cos(i[1] + t) / inten))**2)
        c += 1.0 / length
      c /= 5.0
      c = 1.17 - c ** 1.4
      color = np.clip(np.abs(c) ** 8.0, 0, 1)
      return np.array([color, color, color])

    def refract(incident, normal):
      if np.abs(np.dot(incident, normal)) >= 1.0 - 1e-3:
        return incident
      angle = np.arccos(np.dot(incident, normal))
      out_angle = np.arcsin(np.sin(angle) / eta)
      out_unrotated = np.array([np.cos(out_angle), np.sin(out_angle), 0.0])
      spectator_dim = np.cross(incident, normal)
      spectator_dim /= np.linalg.norm(spectator_dim)
      orthogonal_dim = np.cross(normal, spectator_dim)
      rotation_matrix = np.stack((normal, orthogonal_dim, spectator_dim), axis=0)
      return np.matmul(np.linalg.inv(rotation_matrix), out_unrotated)

    def luma_at_offset(img, origin, offset):
      a, b = origin[0] + offset[0], origin[1] + offset[1]
      inside = 0 <= a < img.shape[0] and 0 <= b < img.shape[1]
      pixel_value = img[a, b, :] if inside else np.array([0.0, 0.0, 0])
      return np.dot(pixel_value, np.array([0.2126, 0.7152, 0.0722]))

    def luma_based_refract(point, img, caustics):
      north_luma = luma_at_offset(caustics, point, np.array([0, -1]))
      south_luma = luma_at_offset(caustics, point, np.array([0, 1]))
      west_luma = luma_at_offset(caustics, point, np.array([-1, 0]))
      east_luma = luma_at_offset(caustics, point, np.array([1, 0]))
      lens_normal = np.array([east_luma - west_luma, south_luma - north_luma, 1.0])
      lens_normal = lens_normal / np.linalg.norm(lens_normal)
      refract_vector = refract(np.array([0.0, 0.0, 1.0]), lens_normal) * lens_scale
      refract_vector = np.round(refract_vector, 3)
      out_pixel = bilinear_interpolation(img, point + refract_vector[0:2])
      out_pixel += (north_luma - south_luma) * lighting_amount
      out_pixel += (east_luma - west_luma) * lighting_amount
      return np.clip(out_pixel, 0, 1)

    noise = self.pixels(lambda y, x: caustic_noise_kernel(np.array([y, x])))
    noise = gaussian_filter(noise, sigma=softening)
    image = image.astype(np.float32) / 255
    out = self.pixels(lambda y, x: luma_based_refract(np.array([y, x]), image, noise))
    return np.clip((out * 255).astype(np.uint8), 0, 255)


# imagenet_c_bar.csv's names, and transform_finder.build_transform(name, severity, 'imagenet').
TRANSFORMS = {t.name: t for t in (CausticRefraction, InverseSparkles, Sparkles, PerlinNoise, BlueNoiseSample,
                                  PlasmaNoise, CheckerBoardCutOut, CocentricSineWaves, SingleFrequencyGreyscale,
                                  BrownishNoise)}


def build_transform(name: str, severity: float, im_size: int = 224) -> Transform:
  return TRANSFORMS[name](severity=severity, im_size=im_size)
