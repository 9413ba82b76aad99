"""Real Fashion-MNIST, as RGB 32x32 uint8 arrays.

The images come from Debian's ``dataset-fashion-mnist`` (the original idx files,
gzipped, under /usr/share/datasets/fashion-mnist/), from a directory given by
``--fashion-mnist-dir``, or, when neither is there, from TFDS ``fashion_mnist``
(which needs the network once). The 28x28 grey images are zero-padded to 32x32
-- the corruption library's minimum size, and lossless, unlike a resize -- and
repeated over 3 channels so the model is an ordinary RGB ViT.
"""

from __future__ import annotations

import gzip
import os
import struct
from typing import Optional

import numpy as np

from pcsr_jax.errors import UserError

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
INSTALL_HINT = "install it with 'apt-get install dataset-fashion-mnist' or pass --fashion-mnist-dir"
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMG_SIZE = 32
_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_COUNTS = {"train": 60000, "test": 10000}


def _find(directory: str, stem: str) -> Optional[str]:
  for name in (stem + ".gz", stem):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      return path
  return None


def _read_idx(path: str, ndim: int) -> np.ndarray:
  """Parses one idx file (magic 0x0000 08 <ndim>, big-endian sizes, uint8 payload)."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError) as e:
    raise UserError(f"{path}: unreadable idx file ({e})") from None
  if len(data) < 4 + 4 * ndim or data[:4] != bytes([0, 0, 8, ndim]):
    raise UserError(f"{path}: not an idx file of uint8 with {ndim} dims (bad magic)")
  shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
  payload = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
  if payload.size != int(np.prod(shape)):
    raise UserError(f"{path}: truncated idx file (expected {int(np.prod(shape))} values, found {payload.size})")
  return payload.reshape(shape)


def to_rgb32(images: np.ndarray) -> np.ndarray:
  """[N, 28, 28] grey uint8 -> [N, 32, 32, 3] uint8, zero-padded by 2 px on each side."""
  pad = (IMG_SIZE - images.shape[1]) // 2
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad)))
  return np.repeat(padded[..., None], 3, axis=-1)


def _from_tfds(split: str) -> tuple[np.ndarray, np.ndarray]:
  try:
    import tensorflow_datasets as tfds

    ds = tfds.as_numpy(tfds.load("fashion_mnist", split=split, batch_size=-1, as_supervised=True))
  except Exception as e:  # no TF, no network, no prepared dataset: all mean "not available"
    raise UserError(f"Fashion-MNIST not found under {DEFAULT_DIR} and TFDS could not provide it "
                    f"({type(e).__name__}); {INSTALL_HINT}") from None
  images, labels = ds
  return np.asarray(images)[..., 0], np.asarray(labels, np.int64)


def load(split: str, directory: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
  """Returns ``(images [N, 32, 32, 3] uint8, labels [N] int64)`` of ``split`` ('train' or 'test').

  ``directory`` given: the idx files must be there. Not given: Debian's location,
  then TFDS.
  """
  if split not in _FILES:
    raise UserError(f"Fashion-MNIST split '{split}': expected train or test")
  search = directory or DEFAULT_DIR
  if directory is not None and not os.path.isdir(directory):
    raise UserError(f"--fashion-mnist-dir {directory}: directory not found")
  img_path, lbl_path = (_find(search, s) for s in _FILES[split])
  if img_path is None or lbl_path is None:
    if directory is not None:
      raise UserError(f"--fashion-mnist-dir {directory}: no {_FILES[split][0]}(.gz) / {_FILES[split][1]}(.gz) "
                      f"inside; {INSTALL_HINT}")
    images, labels = _from_tfds(split)
  else:
    images, labels = _read_idx(img_path, 3), _read_idx(lbl_path, 1).astype(np.int64)
  if images.shape != (_COUNTS[split], 28, 28) or labels.shape != (_COUNTS[split],):
    raise UserError(f"Fashion-MNIST {split} ({img_path or 'tfds'}): expected {_COUNTS[split]} 28x28 images and "
                    f"labels, found {images.shape} and {labels.shape}")
  if labels.min() < 0 or labels.max() >= len(CLASSES):
    raise UserError(f"{lbl_path or 'tfds'}: labels outside 0..9")
  return to_rgb32(images), labels
