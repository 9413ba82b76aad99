"""The release's ImageNet-C pipeline for its six corruptions without randomness, as a reference.

Written from ``hendrycks/robustness:ImageNet-C/create_c/make_imagenet_c.py`` (``DistortImageFolder`` and the
distortion functions), not from `pcsr_jax.data.generators.corruptions`: torchvision's ``Resize(256)`` +
``CenterCrop(224)`` on the PIL image, the corruption at ImageNet strength, ``np.uint8``, a PIL JPEG save at
quality 85 with ``optimize=True``, into ``<out_root>/<corruption>/<severity>/<wnid>/<file name>``. Tests
check that `pcsr_jax.data.generators.generated.CorruptedSource` streams exactly what this folder holds.

Changes to run on today's libraries, none of them numeric: scikit-image's ``multichannel=True`` is
``channel_axis=-1``; the distortion takes the transformed PIL image as the release's does; classes and files
are listed as its ``find_classes`` / ``make_dataset`` list them, without the DataLoader around them.
"""

from __future__ import annotations

import os
from io import BytesIO
from typing import Sequence

import cv2
import numpy as np
import skimage as sk
import torchvision.transforms as trn
from PIL import Image
from scipy.ndimage import zoom as scizoom

IMG_EXTENSIONS = [".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm"]

TRANSFORM = trn.Compose([trn.Resize(256), trn.CenterCrop(224)])


def disk(radius, alias_blur=0.1, dtype=np.float32):
  if radius <= 8:
    L = np.arange(-8, 8 + 1)
    ksize = (3, 3)
  else:
    L = np.arange(-radius, radius + 1)
    ksize = (5, 5)
  X, Y = np.meshgrid(L, L)
  aliased_disk = np.array((X ** 2 + Y ** 2) <= radius ** 2, dtype=dtype)
  aliased_disk /= np.sum(aliased_disk)
  return cv2.GaussianBlur(aliased_disk, ksize=ksize, sigmaX=alias_blur)  # supersample disk to antialias


def clipped_zoom(img, zoom_factor):
  h = img.shape[0]
  ch = int(np.ceil(h / zoom_factor))  # ceil crop height (= crop width)
  top = (h - ch) // 2
  img = scizoom(img[top:top + ch, top:top + ch], (zoom_factor, zoom_factor, 1), order=1)
  trim_top = (img.shape[0] - h) // 2  # trim off any extra pixels
  return img[trim_top:trim_top + h, trim_top:trim_top + h]


def defocus_blur(x, severity=1):
  c = [(3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)][severity - 1]
  x = np.array(x) / 255.
  kernel = disk(radius=c[0], alias_blur=c[1])
  channels = []
  for d in range(3):
    channels.append(cv2.filter2D(x[:, :, d], -1, kernel))
  channels = np.array(channels).transpose((1, 2, 0))  # 3x224x224 -> 224x224x3
  return np.clip(channels, 0, 1) * 255


def zoom_blur(x, severity=1):
  c = [np.arange(1, 1.11, 0.01), np.arange(1, 1.16, 0.01), np.arange(1, 1.21, 0.02), np.arange(1, 1.26, 0.02),
       np.arange(1, 1.31, 0.03)][severity - 1]
  x = (np.array(x) / 255.).astype(np.float32)
  out = np.zeros_like(x)
  for zoom_factor in c:
    out += clipped_zoom(x, zoom_factor)
  x = (x + out) / (len(c) + 1)
  return np.clip(x, 0, 1) * 255


def contrast(x, severity=1):
  c = [0.4, .3, .2, .1, .05][severity - 1]
  x = np.array(x) / 255.
  means = np.mean(x, axis=(0, 1), keepdims=True)
  return np.clip((x - means) * c + means, 0, 1) * 255


def brightness(x, severity=1):
  c = [.1, .2, .3, .4, .5][severity - 1]
  x = np.array(x) / 255.
  x = sk.color.rgb2hsv(x)
  x[:, :, 2] = np.clip(x[:, :, 2] + c, 0, 1)
  x = sk.color.hsv2rgb(x)
  return np.clip(x, 0, 1) * 255


def jpeg_compression(x, severity=1):
  c = [25, 18, 15, 10, 7][severity - 1]
  output = BytesIO()
  x.save(output, "JPEG", quality=c)
  return Image.open(output)


def pixelate(x, severity=1):
  c = [0.6, 0.5, 0.4, 0.3, 0.25][severity - 1]
  x = x.resize((int(224 * c), int(224 * c)), Image.BOX)
  return x.resize((224, 224), Image.BOX)


DISTORTIONS = {f.__name__: f for f in (brightness, contrast, defocus_blur, zoom_blur, pixelate, jpeg_compression)}


def pil_loader(path: str) -> Image.Image:
  with open(path, "rb") as f:
    img = Image.open(f)
    return img.convert("RGB")


def make_dataset(root: str) -> list[tuple[str, str]]:
  """``(path, class folder)`` of every image, in the release's order (sorted classes, sorted files)."""
  classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
  images = []
  for target in classes:
    for dirpath, _, fnames in sorted(os.walk(os.path.join(root, target))):
      for fname in sorted(fnames):
        if any(fname.lower().endswith(ext) for ext in IMG_EXTENSIONS):
          images.append((os.path.join(dirpath, fname), target))
  return images


def write_release_folder(clean_root: str, out_root: str, corruptions: Sequence[str], severity: int) -> None:
  """``<out_root>/<corruption>/<severity>/<wnid>/<file name>`` for every image of ``clean_root``
  (``<wnid>/*.JPEG``), as ``DistortImageFolder.__getitem__`` writes them."""
  for name in corruptions:
    method = DISTORTIONS[name]
    for path, target in make_dataset(clean_root):
      img = method(TRANSFORM(pil_loader(path)), severity)
      save_path = os.path.join(out_root, name, str(severity), target)
      os.makedirs(save_path, exist_ok=True)
      save_path = os.path.join(save_path, os.path.basename(path))
      Image.fromarray(np.uint8(img)).save(save_path, quality=85, optimize=True)
