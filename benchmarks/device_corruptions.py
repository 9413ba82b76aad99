"""The device corruptions (``pcsr_jax/data/generators/corrupt_device.py``) against the host path: distance and speed.

    python -m benchmarks.device_corruptions --images 100 --severity 3
    python -m benchmarks.device_corruptions --builtin 2000 --severity 5   # Source's accuracy, host vs device

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

The host reference is the host path ``--clean-data`` streams: `corruptions.corrupt` at ImageNet strength (the
release's ``make_imagenet_c.py`` functions and tables; see that module for where the ``imagecorruptions``
package, which departs from the release in zoom_blur, pixelate, frost and elastic_transform, is used).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

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


def pil_jpeg(x: np.ndarray) -> np.ndarray:
  """The release's save (``quality=85, optimize=True``) read back (`generated.jpeg_round_trip`)."""
  from pcsr_jax.data.generators import generated

  return np.asarray(generated.jpeg_round_trip(x))


def host_corrupt(x: np.ndarray, corruption: str, severity: float, index: int) -> np.ndarray:
  """The host path of one uint8 image (`corruptions.corrupt` at ImageNet strength, the release's functions and
  tables; what ``--clean-data`` streams): the corruption and ``np.uint8``, before the JPEG round trip."""
  from pcsr_jax.data.generators import corruptions

  return corruptions.corrupt(x, corruption, severity, 0, index, strength="imagenet")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
  mse = np.mean((a.astype(np.float64) - b) ** 2, axis=(1, 2, 3))
  return float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))))


def builtin_accuracy(n: int, severity: int, names: Sequence[str]) -> None:
  """Source's accuracy (the committed built-in model, ``assets/fmnist_vit``) on the first ``n`` Fashion-MNIST
  test images under each device corruption, host path vs device path, at the built-in benchmark's CIFAR-10-C
  strength (the device functions with the CIFAR table rows, 32 px, no JPEG, as Fashion-MNIST-C is stored)."""
  import jax

  from pcsr_jax import checkpoint
  from pcsr_jax.data.generators import corrupt_device as cd
  from pcsr_jax.data import fashion_mnist, transforms
  from pcsr_jax.data.generators import corruptions
  from pcsr_jax.experiments import builtin

  model, params, meta = checkpoint.load(builtin.CHECKPOINT, kind="vit")
  images, labels = fashion_mnist.load("test")
  images, labels = images[:n], labels[:n]
  forward = jax.jit(lambda x: model.apply({"params": params}, x).argmax(-1))
  table = transforms.normalize_table(meta["mean"], meta["std"])
  acc = lambda x: 100 * float(np.mean(np.asarray(forward(table[x, np.arange(3)])) == labels))  # noqa: E731
  print(f"Source ({builtin.CHECKPOINT}) on the first {n} Fashion-MNIST test images, CIFAR-10-C strength, severity "
        f"{severity}, no JPEG; clean {acc(images):.1f}%\n")
  print("| corruption | host % | device % | device - host |\n|---|---|---|---|")
  for name in names:
    host = corruptions.corrupt_batch(images, name, severity, 0, 0, strength="cifar")
    prm = cd.params(name, corruptions.params(name, severity, "cifar"), 32, 32)
    dev = np.asarray(cd.corrupt(images, name, prm, jax.random.key(0), np.arange(n), quality=None))
    h, d = acc(host), acc(dev)
    print(f"| {name} | {h:.1f} | {d:.1f} | {d - h:+.1f} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="device_corruptions.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=100, help="224 px images per corruption")
  p.add_argument("--severity", type=int, default=3, help="ImageNet-C severity 1..5")
  p.add_argument("--batch", type=int, default=50, help="device batch size")
  p.add_argument("--corruptions", default="", help="comma-separated subset (default: all device ones)")
  p.add_argument("--builtin", type=int, metavar="N", help="instead: Source's accuracy on N built-in test images, "
                 "host vs device (CIFAR-10-C strength)")
  a = p.parse_args(argv)
  if a.images < 1 or a.batch < 1 or not 1 <= a.severity <= 5:
    raise UserError(f"--images and --batch must be positive and --severity 1..5, got {a.images}, {a.batch}, "
                    f"{a.severity}")
  import jax

  from pcsr_jax.data.generators import corrupt_device as cd
  from pcsr_jax.data.generators import corruptions

  names = [n for n in a.corruptions.split(",") if n] or list(cd.DEVICE_CORRUPTIONS)
  for n in names:
    cd.check_corruption(n)
  if a.builtin:
    builtin_accuracy(a.builtin, a.severity, names)
    return 0
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
    prm = cd.params(name, corruptions.params(name, a.severity, "imagenet"), 224, 224)
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
