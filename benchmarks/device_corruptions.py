"""The device corruptions (``pcsr_jax/data/corrupt_device.py``) against the host path: distance and speed.

    python -m benchmarks.device_corruptions --images 100 --severity 3

For each corruption the device path implements, at ImageNet strength (the release's table row), on
``--images`` 224 px crops of scikit-image's bundled colour photos (astronaut, chelsea, coffee, rocket,
motorcycle, retina, IHC, Hubble deep field: a random square crop of half to all of the shorter side,
bilinear to 224, random flip; no network), both paths end with the release's ``np.uint8`` and a PIL JPEG
round trip at quality 85. Printed as a markdown table:

* ``mean`` / ``max``: absolute difference of device vs host output in uint8 levels, and ``px%`` the share of
  values that differ. Meaningful for the deterministic corruptions; for the random ones the draws differ
  (numpy's vs ``jax.random``), so those columns only say how strong the corruption is.
* ``PSNR host`` / ``PSNR dev``: mean PSNR (dB) of each path's output to the clean image: the distribution
  check for random corruptions (equal strength gives equal PSNR up to the sampling noise of ``--images``).
* ``img/s``: host (one image at a time, as the release; corruption + JPEG) and device (jitted, one batch of
  ``--batch``, compiled before timing, default JAX backend), both measured in this run, and their ratio.

The host reference is the release's ``make_imagenet_c.py`` as the ``imagecorruptions`` package runs it,
except where that package departs from the release: zoom_blur (the package keeps the zoomed layer's
top-left corner, the release its centre), pixelate (the package upsamples with NEAREST, the release with
BOX), frost (the package rescales all six photos by 1.1, the release crops the first five at full size) and
elastic_transform (the package has no affine step); those four are written here the release's way.
"""

from __future__ import annotations

import io
import time
import warnings
from typing import Sequence

import numpy as np

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

# The release's ImageNet-C rows (make_imagenet_c.py), severities 1..5, for the corruptions the device path has.
IMAGENET_ROWS = {
    "gaussian_noise": (.08, .12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (.03, .06, .09, 0.17, 0.27),
    "speckle_noise": (.15, .2, 0.35, 0.45, 0.6),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    "zoom_blur": tuple(np.arange(1, hi, step) for hi, step in
                       ((1.11, 0.01), (1.16, 0.01), (1.21, 0.02), (1.26, 0.02), (1.31, 0.03))),
    "fog": ((1.5, 2), (2., 2), (2.5, 1.7), (2.5, 1.5), (3., 1.4)),
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    "contrast": (0.4, .3, .2, .1, .05),
    "brightness": (.1, .2, .3, .4, .5),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "elastic_transform": tuple(tuple(244 * v for v in r) for r in  # the release's 244 (sic)
                               ((2, 0.7, 0.1), (2, 0.08, 0.2), (0.05, 0.01, 0.02), (0.07, 0.01, 0.02),
                                (0.12, 0.01, 0.02))),
}
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "retina.jpg",
          "ihc.png", "hubble_deep_field.jpg")  # bundled in scikit-image's wheel (skimage/data)


def sample_images(n: int, size: int = 224, seed: int = 0) -> np.ndarray:
  """uint8 [n, size, size, 3]: random square crops (half to all of the shorter side) of scikit-image's photos."""
  import importlib.resources

  from PIL import Image

  photos = []
  for name in PHOTOS:
    with importlib.resources.as_file(importlib.resources.files("skimage") / "data" / name) as f:
      photos.append(np.asarray(Image.open(f).convert("RGB")))
  rng = np.random.default_rng(seed)
  out = np.empty((n, size, size, 3), np.uint8)
  for i in range(n):
    img = photos[rng.integers(len(photos))]
    h, w = img.shape[:2]
    side = int(min(h, w) * rng.uniform(0.5, 1.0))
    top, left = rng.integers(h - side + 1), rng.integers(w - side + 1)
    crop = Image.fromarray(img[top:top + side, left:left + side]).resize((size, size), Image.BILINEAR)
    out[i] = np.asarray(crop)[:, ::-1] if rng.integers(2) else np.asarray(crop)
  return out


def pil_jpeg(x: np.ndarray, quality: int = 85) -> np.ndarray:
  """The release's save (``quality=85, optimize=True``) read back."""
  from PIL import Image

  buf = io.BytesIO()
  Image.fromarray(x).save(buf, "JPEG", quality=quality, optimize=True)
  buf.seek(0)
  return np.asarray(Image.open(buf).convert("RGB"))


def _zoom_release(x: np.ndarray, factors) -> np.ndarray:
  from scipy.ndimage import zoom

  x = (x / 255.0).astype(np.float32)
  out = np.zeros_like(x)
  h = x.shape[0]
  for f in factors:
    ch = int(np.ceil(h / f))
    top = (h - ch) // 2
    z = zoom(x[top:top + ch, top:top + ch], (f, f, 1), order=1)
    trim = (z.shape[0] - h) // 2
    out += z[trim:trim + h, trim:trim + h]
  return np.clip((x + out) / (len(factors) + 1), 0, 1) * 255


def _pixelate_release(x: np.ndarray, c: float) -> np.ndarray:
  from PIL import Image

  h, w = x.shape[:2]
  small = Image.fromarray(x).resize((int(w * c), int(h * c)), Image.BOX)
  return np.asarray(small.resize((w, h), Image.BOX))


def _frost_release(x: np.ndarray, c) -> np.ndarray:
  import importlib.resources

  import cv2

  name = ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg")[np.random.randint(5)]
  with importlib.resources.as_file(importlib.resources.files("imagecorruptions") / "frost" / name) as p:
    frost = cv2.imread(str(p))
  h, w = x.shape[:2]
  top, left = np.random.randint(0, frost.shape[0] - h), np.random.randint(0, frost.shape[1] - w)
  return np.clip(c[0] * x + c[1] * frost[top:top + h, left:left + w][..., ::-1], 0, 255)


def host_corrupt(x: np.ndarray, corruption: str, severity: int, seed: int) -> np.ndarray:
  """The host reference of one uint8 image: the corruption and ``np.uint8`` (no JPEG)."""
  import imagecorruptions

  from pcsr_jax.data import corruptions

  c = IMAGENET_ROWS[corruption][severity - 1]
  np.random.seed(seed)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if corruption == "zoom_blur":
      out = _zoom_release(x, c)
    elif corruption == "pixelate":
      out = _pixelate_release(x, c)
    elif corruption == "frost":
      out = _frost_release(x, c)
    elif corruption == "elastic_transform":
      out = corruptions.elastic_transform(x, c)  # the release's affine + displacement, shape-generic
    else:
      out = imagecorruptions.corrupt(x, corruption_name=corruption, severity=severity)
  return np.uint8(out)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
  mse = np.mean((a.astype(np.float64) - b) ** 2, axis=(1, 2, 3))
  return float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))))


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="device_corruptions.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=100, help="224 px images per corruption")
  p.add_argument("--severity", type=int, default=3, help="ImageNet-C severity 1..5")
  p.add_argument("--batch", type=int, default=50, help="device batch size")
  p.add_argument("--corruptions", default="", help="comma-separated subset (default: all device ones)")
  a = p.parse_args(argv)
  if a.images < 1 or a.batch < 1 or not 1 <= a.severity <= 5:
    raise UserError(f"--images and --batch must be positive and --severity 1..5, got {a.images}, {a.batch}, "
                    f"{a.severity}")
  import jax

  from pcsr_jax.data import corrupt_device as cd

  names = [n for n in a.corruptions.split(",") if n] or list(cd.DEVICE_CORRUPTIONS)
  for n in names:
    cd.check_corruption(n)
  clean = sample_images(a.images)
  key, keys = jax.random.key(0), np.arange(a.images)
  b = min(a.batch, a.images)
  print(f"{a.images} images (224 px crops of scikit-image's photos), severity {a.severity}, JPEG q85 after "
        f"both; device: jax {jax.default_backend()}, batch {b}\n")
  print("| corruption | kind | mean | max | px% | PSNR host | PSNR dev | host img/s | dev img/s | dev/host |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name in names:
    t0 = time.perf_counter()
    host = np.stack([pil_jpeg(host_corrupt(x, name, a.severity, i)) for i, x in enumerate(clean)])
    host_rate = a.images / (time.perf_counter() - t0)
    prm = cd.params(name, IMAGENET_ROWS[name][a.severity - 1], 224, 224)
    run = lambda i: cd.corrupt(clean[i:i + b], name, prm, key, keys[i:i + b])  # noqa: E731
    run(0).block_until_ready()  # compile
    t0 = time.perf_counter()
    dev = np.concatenate([np.asarray(run(i)) for i in range(0, a.images, b)])
    dev_rate = a.images / (time.perf_counter() - t0)
    d = np.abs(dev.astype(np.int32) - host)
    kind = "random" if name in cd.RANDOM else "determ."
    print(f"| {name} | {kind} | {d.mean():.4f} | {d.max()} | {100 * (d > 0).mean():.3f} | {_psnr(host, clean):.2f} "
          f"| {_psnr(dev, clean):.2f} | {host_rate:.1f} | {dev_rate:.1f} | {dev_rate / host_rate:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main)
