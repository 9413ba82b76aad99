"""ImageNet-C generated in the stream from clean images, the release's way.

Hendrycks' ``make_imagenet_c.py`` made each ImageNet-C image from a clean
validation image: torchvision ``Resize(256)`` (bilinear, on the PIL image) and
``CenterCrop(224)``, the corruption at ImageNet strength, ``np.uint8`` (a
truncation) and a PIL JPEG save at quality 85 with ``optimize=True``.
`CorruptedSource` does the same in memory, per image: `release_crop`, then
`corruptions.corrupt` at ``strength="imagenet"``, then `jpeg_round_trip`. For
the corruptions that draw no random numbers its images equal, bit for bit, what
a folder written that way reads back (``benchmarks/torch_methods/
make_imagenet_c.py`` writes one with torchvision and the release's code; the
tests compare the two). Random corruptions cannot match the release's pixels
(it drew from numpy's unseeded global generator in 4 workers); here each image
draws from a seed of ``(seed, corruption, severity, image_key(name))``, so an
image regenerates alone and the same, whatever the order, ``--limit``, resume
point or process.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np
from PIL import Image

from pcsr_jax.data import transforms
from pcsr_jax.data.generators import corruptions, corruptions_bar
from pcsr_jax.errors import UserError

VERSION = 1  # bump when the output of any image changes (it is part of the harness's resume key)
CROP, RESIZE, QUALITY = 224, 256, 85

# Resize(256) + CenterCrop(224) is the project's resize-then-crop with crop_pct 224 / 256 and bilinear
# resampling: the shorter side to 256, the longer one truncated (torchvision's int(256 * long / short)), crop
# offsets rounded as torchvision's CenterCrop rounds them. Mean and std are unused (`to_uint8` only).
_CROP = transforms.Preprocess(img_size=CROP, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), interpolation="bilinear",
                              crop_pct=CROP / RESIZE)


def release_crop(img: Image.Image | np.ndarray) -> np.ndarray:
  """torchvision's ``Resize(256)`` + ``CenterCrop(224)`` of a PIL image (converted to RGB, as the release's
  loader did) or of a uint8 HWC array of any size: uint8 ``[224, 224, 3]``."""
  return _CROP.to_uint8(Image.fromarray(img) if isinstance(img, np.ndarray) else img)


def jpeg_round_trip(x: np.ndarray, quality: int = QUALITY) -> Image.Image:
  """The image that reading back the release's ``Image.fromarray(np.uint8(x)).save(path, quality=85,
  optimize=True)`` gives, made in memory."""
  buf = io.BytesIO()
  Image.fromarray(np.uint8(x)).save(buf, format="JPEG", quality=quality, optimize=True)
  buf.seek(0)
  with Image.open(buf) as img:
    img.load()
    return img


def image_key(name: str) -> int:
  """A stable 63-bit key of an image's file name (the last part of ``n01440764/ILSVRC2012_val_00000293.JPEG``,
  either separator): the index that seeds its random draws. The file name alone, so that a class folder and
  TFDS (which lists bare file names) give an image the same draws; ImageNet's val file names are unique."""
  base = name.replace("\\", "/").rsplit("/", 1)[-1]
  digest = hashlib.sha256(base.encode()).digest()
  return int.from_bytes(digest[:8], "big") >> 1


class _OverClean:
  """A source over a clean one: its labels, names (and files, for `sources.files_digest`) and class count, and
  `crop`, the release's centre crop of a clean image."""

  def __init__(self, clean: Any, corruption: str, severity: float, seed: int):
    seed = corruptions.check_seed(seed)  # a one-line UserError before any image, not one per image
    self.clean, self.corruption, self.severity, self.seed = clean, corruption, float(severity), seed
    self.labels, self.names = clean.labels, clean.names
    self.num_label_classes, self.imagenet_labels = clean.num_label_classes, clean.imagenet_labels
    if hasattr(clean, "paths"):  # `sources.files_digest` then tracks the clean files
      self.paths = clean.paths

  def __len__(self) -> int:
    return len(self.clean)

  def crop(self, i: int) -> np.ndarray:
    return release_crop(self.clean.load(i))


class CorruptedSource(_OverClean):
  """A clean image source seen through one corruption at ImageNet strength: ImageNet-C made on the fly.

  ``clean`` is any project source (`pcsr_jax.data.sources`); this one has its labels, names and class count,
  and ``load(i)`` returns ``jpeg_round_trip(corrupt(release_crop(clean.load(i)), ...))``, a 224 px PIL
  image. ``severity`` 0 or in [`corruptions.MIN_FRACTIONAL_SEVERITY`, 5], fractions allowed
  (`corruptions.params`); ``seed`` (`corruptions.check_seed`: 0 to 2**32 - 1) changes the random draws of every
  image. A failure to read a clean image is `sources.Unreadable` (the loader skips it); one of the corruption
  propagates as itself. Picklable when ``clean`` is (the loader may send it to worker processes). Random
  corruptions hold a per-process lock while they draw from numpy's global generator, so within one process
  they run one image at a time: the loader's worker processes, not its threads, make them parallel.
  """

  def __init__(self, clean: Any, corruption: str, severity: float, seed: int = 0):
    if corruption in corruptions_bar.NAMES:  # ImageNet-C-bar: its 5 csv levels, no fractions
      if float(severity) not in (1, 2, 3, 4, 5):
        raise UserError(f"--severity {severity:g}: ImageNet-C-bar's {corruption} has severities 1 to 5 only")
      severity = int(severity)
    else:
      corruptions.params(corruption, severity, "imagenet")  # a one-line UserError for a bad name or severity
    super().__init__(clean, corruption, severity, seed)

  @property
  def describe(self) -> str:
    """What makes the images besides the clean files: part of the harness's resume key."""
    return f"generated v{VERSION} {self.corruption} {self.severity:g} seed {self.seed}"

  def corrupted(self, i: int) -> np.ndarray:
    """Image ``i`` before the JPEG round trip: the uint8 array the release saved."""
    key = image_key(self.names[i])
    if self.corruption in corruptions_bar.NAMES:
      return corruptions_bar.corrupt(self.crop(i), self.corruption, int(self.severity), self.seed, key)
    return corruptions.corrupt(self.crop(i), self.corruption, self.severity, self.seed, key, strength="imagenet")

  def load(self, i: int) -> Image.Image:
    return jpeg_round_trip(self.corrupted(i))


class CleanCrops(_OverClean):
  """The device path's source (``--corrupt-on device``): `CorruptedSource`'s images before the corruption.

  ``load(i)`` is the release's centre crop of clean image ``i`` (uint8 [224, 224, 3]); the harness corrupts
  and JPEG-round-trips the placed batch on the accelerator (`corrupt_device.BatchCorrupter`), keyed per image
  by `image_key` of its name (`keys`). Same labels, names and class count as the clean source.
  """

  def __init__(self, clean: Any, corruption: str, severity: float, seed: int = 0):
    severity = corruptions.check_fractional_severity(severity)  # the device has no severity 0 (`BatchCorrupter`)
    corruptions.params(corruption, severity, "imagenet")
    super().__init__(clean, corruption, severity, seed)

  @property
  def describe(self) -> str:
    return f"generated on the device v{VERSION} {self.corruption} {self.severity:g} seed {self.seed}"

  def load(self, i: int) -> np.ndarray:
    return self.crop(i)

  def keys(self, names) -> np.ndarray:
    """`image_key` of each name, for the device's per-image draws."""
    return np.asarray([image_key(n) for n in names], np.int64)
