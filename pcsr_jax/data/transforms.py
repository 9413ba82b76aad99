"""Preprocessing from a checkpoint's metadata, in PIL + numpy (no torch, no TensorFlow).

timm's eval transform: resize the shorter side to ``floor(img_size / crop_pct)``
with the checkpoint's interpolation, center crop ``img_size``, scale to [0, 1],
normalize with the checkpoint's mean and std. The papers' ImageNet-C protocol
feeds Hendrycks' 224 px images through a plain center crop
(`imagenet_c_preprocess`: no resize unless an image is smaller than the model);
VisDA-2021's authors' code resizes to a square first (`visda_preprocess`).

`Preprocess.to_uint8` does the geometry only and returns uint8 HWC: what the
loader hands the engine, which normalizes on the device (4x fewer bytes to
move than float32). Calling the `Preprocess` returns float32 HWC, normalized
on the host with the same arithmetic (`normalize`); `normalize_table` tabulates
that arithmetic for every uint8 value, so the device's lookup is bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

_INTERP = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST,
           "lanczos": Image.LANCZOS}
# interpolation "none": the model takes images at its own size only (the built-in benchmark's 32 px).


@dataclasses.dataclass(frozen=True)
class Preprocess:
  img_size: int
  mean: tuple[float, ...]
  std: tuple[float, ...]
  interpolation: str = "bicubic"
  crop_pct: float = 1.0
  crop_only: bool = False  # ImageNet-C: center crop without resizing (unless the image is too small)
  square_resize: bool = False  # VisDA-2021's code: Resize((s, s)), aspect not kept, then the center crop

  @staticmethod
  def from_meta(meta: Mapping[str, Any], crop_pct: float | None = None) -> "Preprocess":
    return Preprocess(int(meta["img_size"]), tuple(meta["mean"]), tuple(meta["std"]),
                      meta.get("interpolation", "bicubic"),
                      float(meta.get("crop_pct", 1.0) if crop_pct is None else crop_pct))

  @property
  def resize_to(self) -> int:
    return int(math.floor(self.img_size / self.crop_pct))

  def __call__(self, img: Image.Image | np.ndarray) -> np.ndarray:
    """Float32 HWC, normalized on the host: `to_uint8` then `normalize`."""
    if isinstance(img, np.ndarray):  # in-memory uint8 HWC (the built-in benchmark): already at size
      self._check_array(img)
      return self.normalize(img)
    return self.normalize(self.to_uint8(img))

  def _check_array(self, img: np.ndarray) -> None:
    if img.shape != (self.img_size, self.img_size, 3):
      raise ValueError(f"array image of shape {img.shape}, expected {(self.img_size, self.img_size, 3)}")

  def to_uint8(self, img: Image.Image | np.ndarray) -> np.ndarray:
    """The resize and crop, without normalizing: uint8 HWC ``[img_size, img_size, 3]``."""
    if isinstance(img, np.ndarray):
      self._check_array(img)
      if img.dtype != np.uint8:
        raise ValueError(f"array image of dtype {img.dtype}, expected uint8")
      return img
    img = img.convert("RGB")
    w, h = img.size
    s = self.img_size if self.crop_only else self.resize_to
    if self.square_resize:
      img, w, h = img.resize((s, s), _INTERP[self.interpolation]), s, s
    elif min(w, h) != s and not (self.crop_only and min(w, h) > s):
      # Shorter side to s, aspect kept (torchvision Resize(int)): the long side is truncated.
      nw, nh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
      if self.interpolation not in _INTERP:
        raise ValueError(f"image of size {img.size} needs resizing, but interpolation is '{self.interpolation}'")
      img = img.resize((nw, nh), _INTERP[self.interpolation])
      w, h = nw, nh
    left, top = int(round((w - self.img_size) / 2.0)), int(round((h - self.img_size) / 2.0))
    img = img.crop((left, top, left + self.img_size, top + self.img_size))
    return np.asarray(img, np.uint8)

  def normalize(self, img: Image.Image | np.ndarray) -> np.ndarray:
    """``(x / 255 - mean) / std`` in float32 over the last (channel) axis, for one image or a batch."""
    return normalize(img, self.mean, self.std)


def normalize(img: Image.Image | np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
  """The checkpoint's normalization on the host, in float32: ``(x / 255 - mean) / std``."""
  x = np.asarray(img, np.float32) / 255.0
  return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def normalize_table(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
  """`normalize` of every uint8 value per channel: ``table[v, c]``, float32 ``[256, channels]``.

  The device normalizes uint8 images by looking values up in this table rather than by recomputing
  the arithmetic: XLA rewrites ``x / broadcast(s)`` as ``x * (1 / s)``, which is one ulp off for
  most values, while a lookup returns the host's float32 results exactly, on every backend.
  """
  values = np.repeat(np.arange(256, dtype=np.uint8)[:, None], len(mean), axis=1)
  return normalize(values, mean, std)


def imagenet_c_preprocess(meta: Mapping[str, Any]) -> Preprocess:
  """ImageNet-C: center crop to the model's size, then the checkpoint's normalization."""
  return dataclasses.replace(Preprocess.from_meta(meta, crop_pct=1.0), crop_only=True)


def visda_preprocess(meta: Mapping[str, Any]) -> Preprocess:
  """VisDA-2021 as the authors' code reads it: Resize((256, 256)) (bilinear, aspect not kept), CenterCrop(224),
  then the checkpoint's normalization; 256 = 224 / 0.875 scales with the model's size."""
  return dataclasses.replace(Preprocess.from_meta(meta, crop_pct=0.875), interpolation="bilinear",
                             square_resize=True)
