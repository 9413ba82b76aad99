"""Host vs device corruptions at small and fractional severities: where each path stays faithful (issue 59).

    python -m benchmarks.device_small_severity                   # ImageNet strength: 224 px, JPEG q85 after both
    python -m benchmarks.device_small_severity --strength cifar  # the built-in benchmark's rows: 32 px, no JPEG
    python -m benchmarks.device_small_severity --severities 1e-10,0.01 --corruptions shot_noise --images 16

At a severity s in (0, 1) the tables interpolate between row 0 ("no corruption") and row 1 (`corruptions.params`),
so a small s asks for a nearly clean image; shot noise interpolates ``1 / photons``, so its photon count is
``60 / s`` at ImageNet strength (``500 / s`` at CIFAR's): 6e11 at s = 1e-10. This script runs every corruption at
every ``--severities`` value (by default from 1e-300 up to 5, below `corruptions.MIN_FRACTIONAL_SEVERITY` too:
the rows are taken without the range check, to show why the minimum is where it is) on ``--images`` crops of
scikit-image's bundled photos (`device_corruptions.sample_images`), through

* the host path, the reference: `corruptions.corrupt`'s functions and seeding (its ``np.uint8``), then at
  ImageNet strength the release's PIL save at quality 85, read back;
* the device path: `corrupt_device.corrupt` of `corrupt_device.params` of the same row, then `corrupt_device.jpeg`
  at ImageNet strength (the default JAX backend: this machine's CPU unless a GPU is present),

and prints one markdown row per (corruption, severity): ``raw max`` / ``raw px%``, the largest difference and the
share of differing values in uint8 levels before the JPEG, where the deterministic corruptions' published
bounds (`corrupt_device`'s docstring) are stated: ``ok`` when the exact ones (contrast, pixelate, JPEG) differ
nowhere and brightness, saturate and the blurs by at most 1 level (their shares are measured, not bounded:
~42% for defocus_blur below severity 1/3, where its disk is one pixel); ``mean`` / ``max``, the same after the
JPEG (what the model sees); ``MSE host`` / ``MSE dev``, each path's mean squared change to the clean image
(uint8 levels**2, after the JPEG at ImageNet strength), and ``dMSE``, their relative difference with its
standard error over the images (paired: the same clean image on both paths). The MSE is the check of the random
corruptions, whose draws differ (numpy's vs ``jax.random``) and whose strengths must not: ``ok`` when the
device's is within 10% of the host's (the tolerance of ``tests/test_corrupt_device.py``'s distribution test)
or the difference is within 3 standard errors (fog, frost and elastic draw a few numbers per image -- a plasma
map, a photo crop, an affine jitter -- so a few images sample them noisily). The MSE, not the PSNR: without
the JPEG (CIFAR strength) a nearly clean image's PSNR is dominated by whether any value moved at all. An
exception on either path is printed in its place (e.g. numpy's ``lam value too large``). The host-only
corruptions (glass and motion blur, snow, spatter) get a host column only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from benchmarks.device_corruptions import pil_jpeg, sample_images
from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

SEVERITIES = (1e-300, 1e-100, 1e-20, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-3, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5,
              1, 1.5, 2.75, 3, 4.25, 5)
MSE_TOLERANCE = 0.1  # relative: the random corruptions' check (or 3 standard errors, module doc)
EXACT = ("contrast", "pixelate", "jpeg_compression")
FLOAT_MAX = 1  # levels: the float32 deterministic corruptions' bound before the JPEG


def host_images(x: np.ndarray, name: str, severity: float, strength: str) -> np.ndarray:
  """The host path of ``x`` (uint8 [n, H, W, 3]) at ``severity``, the range check skipped: ``np.uint8`` output."""
  from pcsr_jax.data.generators import corruptions

  row = corruptions._row(name, float(severity), strength)
  return np.stack([corruptions._corrupt_row(im, name, severity, row, 0, i, strength) for i, im in enumerate(x)])


def device_images(x: np.ndarray, name: str, severity: float, strength: str) -> np.ndarray:
  """The device path of the same row, before the JPEG."""
  import jax

  from pcsr_jax.data.generators import corrupt_device as cd
  from pcsr_jax.data.generators import corruptions

  p = cd.params(name, corruptions._row(name, float(severity), strength), x.shape[1], x.shape[2])
  return np.asarray(cd.corrupt(x, name, p, jax.random.key(0), np.arange(len(x)), quality=None))


def mse(a: np.ndarray, clean: np.ndarray) -> np.ndarray:
  """Per-image mean squared difference (uint8 levels**2) of [n, H, W, 3] ``a`` to ``clean``."""
  return np.mean((a.astype(np.float64) - clean) ** 2, axis=(1, 2, 3))


def relative_difference(dev: np.ndarray, host: np.ndarray) -> tuple[float, float]:
  """``(mean(dev) - mean(host)) / mean(host)`` of per-image values and its standard error (paired images)."""
  scale = max(float(host.mean()), 1e-12)
  d = (dev - host) / scale
  return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''}".replace("|", "/")


def verdict(name: str, raw: np.ndarray, mse_host: np.ndarray, mse_dev: np.ndarray) -> str:
  """``ok`` where the device is within the published distance of the host (module doc), else ``FAIL``."""
  from pcsr_jax.data.generators import corrupt_device as cd

  if name in cd.RANDOM:
    rel, se = relative_difference(mse_dev, mse_host)
    return "ok" if abs(rel) <= max(MSE_TOLERANCE, 3 * se) else "FAIL"
  if name in EXACT:
    return "ok" if raw.max() == 0 else "FAIL"
  return "ok" if raw.max() <= FLOAT_MAX else "FAIL"


def rows(clean: np.ndarray, names: Sequence[str], severities: Sequence[float], strength: str):
  """One printed row per (corruption, severity)."""
  import jax.numpy as jnp

  from pcsr_jax.data.generators import corrupt_device as cd

  stored = (lambda a: np.stack([pil_jpeg(im) for im in a])) if strength == "imagenet" else (lambda a: a)
  dev_stored = (lambda a: np.asarray(cd.jpeg(jnp.asarray(a), 85))) if strength == "imagenet" else (lambda a: a)
  for name in names:
    for s in severities:
      try:
        host = host_images(clean, name, s, strength)
        host_out = stored(host)
        host_mse = mse(host_out, clean)
        host_cell = f"{host_mse.mean():.4g}"
      except Exception as e:  # noqa: BLE001 -- the behaviour being measured
        host, host_cell = None, _error(e)
      if name not in cd.DEVICE_CORRUPTIONS:
        yield f"| {name} | {s:g} | host only | | | | | {host_cell} | | | |"
        continue
      try:
        dev = device_images(clean, name, s, strength)
        dev_out = dev_stored(dev)
        dev_mse = mse(dev_out, clean)
      except Exception as e:  # noqa: BLE001
        yield f"| {name} | {s:g} | | | | | | {host_cell} | {_error(e)} | | FAIL |"
        continue
      if host is None:
        yield f"| {name} | {s:g} | | | | | | {host_cell} | {dev_mse.mean():.4g} | | host fails |"
        continue
      raw = np.abs(dev.astype(np.int32) - host)
      d = np.abs(dev_out.astype(np.int32) - host_out)
      rel, se = relative_difference(dev_mse, host_mse)
      yield (f"| {name} | {s:g} | {'random' if name in cd.RANDOM else 'determ.'} | {raw.max()} | "
             f"{100 * (raw > 0).mean():.3f} | {d.mean():.4f} | {d.max()} | {host_cell} | {dev_mse.mean():.4g} | "
             f"{100 * rel:+.1f}% ± {100 * se:.1f} | {verdict(name, raw, host_mse, dev_mse)} |")


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="device_small_severity.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--images", type=int, default=8, help="crops per corruption and severity")
  p.add_argument("--strength", choices=["imagenet", "cifar"], default="imagenet",
                 help="imagenet: 224 px, JPEG q85 after both paths; cifar: the built-in benchmark's rows, 32 px")
  p.add_argument("--severities", default="", help="comma-separated (default: 1e-300 ... 5, see SEVERITIES)")
  p.add_argument("--corruptions", default="", help="comma-separated subset (default: all 19)")
  a = p.parse_args(argv)
  from pcsr_jax.data.generators import corruptions

  try:
    severities = [float(v) for v in a.severities.split(",") if v] or list(SEVERITIES)
  except ValueError:
    raise UserError(f"--severities: expected comma-separated numbers, got '{a.severities}'") from None
  if a.images < 1 or not all(0 < s <= corruptions.MAX_SEVERITY for s in severities):
    raise UserError(f"--images must be positive and --severities in (0, 5], got {a.images}, {a.severities}")
  names = [n for n in a.corruptions.split(",") if n] or list(corruptions.ALL)
  for n in names:
    if n not in corruptions.ALL:
      raise UserError(f"--corruptions: unknown corruption '{n}'")
  import jax

  size = 224 if a.strength == "imagenet" else 32
  clean = sample_images(a.images, size=size)
  print(f"{a.images} crops of scikit-image's photos at {size} px, {a.strength} strength"
        f"{', JPEG q85 after both paths' if a.strength == 'imagenet' else ', no JPEG'}; device: jax "
        f"{jax.default_backend()}; minimum accepted severity {corruptions.MIN_FRACTIONAL_SEVERITY:g}\n")
  print("| corruption | severity | kind | raw max | raw px% | mean | max | MSE host | MSE dev | dMSE | device |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for line in rows(clean, names, severities, a.strength):
    print(line, flush=True)
  return 0


if __name__ == "__main__":
  run_cli(main)
