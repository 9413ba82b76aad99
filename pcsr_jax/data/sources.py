"""Random-access image sources: class folders, image lists, and TFDS ``imagenet2012_corrupted``.

A source has ``labels`` (int32, ImageNet-1k indices unless a folder holds
non-wnid class names), ``names`` (a file name per item) and ``load(i) -> PIL
image``. Items are in a fixed order -- class folders sorted by wnid, files
sorted by name -- so that SAR's label-shift index files (``class*50 + k``)
address the same images.

``load`` raises `Unreadable` for an image that cannot be read or decoded (read
through `read_image` / `decode_image`), and only for that: the loader skips and
counts those (`loader.Loader`), while anything else a source raises -- a
generated source's corruption failing, a bug -- ends the stream as the error it
is.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import struct
import zlib
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from pcsr_jax.data import imagenet
from pcsr_jax.errors import UserError

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".webp", ".ppm")


class Unreadable(Exception):
  """An image that cannot be read or decoded: a missing, truncated or broken file, a TFDS record that fails to
  decode. The one exception `loader.Loader` counts as an unreadable image instead of stopping."""


# What opening and decoding a broken file raises: OSError (a missing file, PIL's UnidentifiedImageError, "image
# file is truncated", "broken data stream"), and what PIL's format plugins raise for malformed headers and data
# (SyntaxError, EOFError, ValueError, IndexError, struct.error, zlib.error), and PIL's DecompressionBombError.
DECODE_ERRORS = (OSError, EOFError, SyntaxError, ValueError, IndexError, struct.error, zlib.error,
                 Image.DecompressionBombError)


def read_image(path: str) -> Image.Image:
  """The image file ``path``, decoded (PIL, loaded); `Unreadable` when it cannot be read or decoded. Only
  regular files: opening a FIFO or a device named *.JPEG would block a decode thread for good."""
  try:
    if not stat.S_ISREG(os.stat(path).st_mode):
      raise Unreadable(f"{path}: not a regular file")
    with Image.open(path) as img:
      img.load()
      return img
  except DECODE_ERRORS as e:
    raise Unreadable(f"{path}: {type(e).__name__}: {e}") from e


def decode_image(data: bytes, what: str) -> Image.Image:
  """Encoded image bytes (a TFDS record's) decoded by PIL; `Unreadable`, naming ``what``, when they cannot be."""
  try:
    with Image.open(io.BytesIO(data)) as img:
      img.load()
      return img
  except DECODE_ERRORS as e:
    raise Unreadable(f"{what}: {type(e).__name__}: {e}") from e


def listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except OSError as e:  # a class folder without read permission, a vanished mount
    raise UserError(f"{path}: cannot list the folder ({e.strerror or type(e).__name__})") from None


class FolderSource:
  """``<root>/<class>/<image>``. Class folders named by ImageNet wnids get ImageNet-1k labels;
  otherwise the sorted folder names are the classes 0..K-1."""

  def __init__(self, root: str):
    if not os.path.isdir(root):
      raise UserError(f"{root}: data folder not found")
    classes = sorted(d for d in listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
      raise UserError(f"{root}: no class folders inside (expected <root>/<wnid>/*.JPEG)")
    index = {w: i for i, w in enumerate(imagenet.wnids())}
    self.imagenet_labels = all(c in index for c in classes)
    self.classes = classes
    self.num_label_classes = len(index) if self.imagenet_labels else len(classes)
    paths, labels = [], []
    for ci, c in enumerate(classes):
      files = sorted(f for f in listdir(os.path.join(root, c)) if f.lower().endswith(IMAGE_EXTENSIONS))
      paths += [os.path.join(root, c, f) for f in files]
      labels += [index[c] if self.imagenet_labels else ci] * len(files)
    if not paths:
      raise UserError(f"{root}: no images in its class folders")
    self.root = root
    self.paths = paths
    self.labels = np.asarray(labels, np.int32)
    self.names = [os.path.relpath(p, root) for p in paths]

  def __len__(self) -> int:
    return len(self.paths)

  def load(self, i: int) -> Image.Image:
    return read_image(self.paths[i])


class ImageListSource:
  """An image list (VisDA-2021's release format): lines ``relative/path.jpg <label>`` under ``root``,
  labels being ImageNet-1k class indices; ``open_set`` also accepts label 1000, "no ImageNet class"."""

  def __init__(self, root: str, list_file: str, open_set: bool = False):
    path = list_file if os.path.isabs(list_file) else os.path.join(root, list_file)
    if not os.path.isfile(path):
      raise UserError(f"{path}: image list not found")
    top = 1000 if open_set else 999
    paths, labels = [], []
    with open(path) as f:
      for n, line in enumerate(f, 1):
        parts = line.split()
        if not parts:
          continue
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
          raise UserError(f"{path}:{n}: expected '<relative/path> <label>', got '{line.strip()}'")
        if not 0 <= int(parts[1]) <= top:
          raise UserError(f"{path}:{n}: label {parts[1]} outside 0..{top}")
        paths.append(os.path.join(root, parts[0]))
        labels.append(int(parts[1]))
    if not paths:
      raise UserError(f"{path}: empty image list")
    self.paths, self.labels = paths, np.asarray(labels, np.int32)
    self.names = [os.path.relpath(p, root) for p in paths]
    self.num_label_classes = 1000
    self.imagenet_labels = True

  def __len__(self) -> int:
    return len(self.paths)

  load = FolderSource.load


class TFDSSource:
  """TFDS ``imagenet2012_corrupted/<corruption>_<severity>`` (validation split), or another image dataset, via
  ``tfds.data_source``: array_record random access, no TensorFlow. Images come as encoded
  bytes (``SkipDecoding``) and are decoded by the loader's workers with PIL."""

  def __init__(self, corruption: Optional[str], severity: Optional[int], data_dir: Optional[str] = None,
               name: str = "imagenet2012_corrupted", split: str = "validation"):
    import tensorflow_datasets as tfds

    # ``corruption=None``: the dataset ``name`` itself (clean ``imagenet2012`` as source data).
    config = f"{name}/{corruption}_{severity}" if corruption is not None else name
    self.config, self.split = config, split
    self.ds = None
    for decoders in ({"image": tfds.decode.SkipDecoding()}, None):  # encoded bytes if possible (cheap)
      try:
        ds = tfds.data_source(config, split=split, data_dir=data_dir, decoders=decoders)
        if len(ds):
          ds[0]  # SkipDecoding can fail at access time (e.g. under tfds.testing.mock_data without TF)
        self.ds = ds
        break
      except Exception as e:  # DatasetNotFoundError and friends: one line, not a traceback
        error = e
    if self.ds is None:
      # The first line of TFDS's own message names the cause (e.g. an unknown split and the ones there are).
      why = (str(error).strip().splitlines() or [""])[0][:200]
      raise UserError(f"tfds {config} split {split}: cannot open it in {data_dir or 'the default TFDS dir'} "
                      f"({type(error).__name__}{': ' + why if why else ''})") from None
    n = len(self.ds)
    if n == 0:
      raise UserError(f"tfds {config}: empty {split} split")
    records = [self.ds[i] for i in range(n)]  # bytes only: cheap
    self.labels = np.asarray([int(r["label"]) for r in records], np.int32)
    self.names = [r["file_name"].decode() if isinstance(r["file_name"], bytes) else str(r["file_name"])
                  for r in records]
    # Sorted by (label, file name), the order of Hendrycks' folders, so SAR's index files apply.
    order = np.lexsort((np.asarray(self.names), self.labels))
    self.order = order
    self.labels, self.names = self.labels[order], [self.names[i] for i in order]
    self.num_label_classes = 1000
    self.imagenet_labels = True

  def __len__(self) -> int:
    return len(self.labels)

  def load(self, i: int) -> Image.Image:
    try:
      img = self.ds[int(self.order[i])]["image"]
    except Exception as e:  # noqa: BLE001 -- reading (and, without SkipDecoding, decoding) one record, nothing else
      raise Unreadable(f"tfds {self.config} {self.names[i]}: {type(e).__name__}: {e}") from e
    if isinstance(img, (bytes, np.bytes_)):
      return decode_image(bytes(img), f"tfds {self.config} {self.names[i]}")
    try:
      return Image.fromarray(np.asarray(img))
    except DECODE_ERRORS as e:  # TFDS decoded the record into something that is not an image
      raise Unreadable(f"tfds {self.config} {self.names[i]}: {type(e).__name__}: {e}") from e


# VisDA-2021's official validation list, as released and as the TTA repositories rename it.
VISDA_LISTS = ("val_filelists/imagenet_c_r_o_filelist.txt", "imagenet_c_r_o_filelist.txt", "imagenet_c_r.txt")


def visda_source(root: str, list_file: Optional[str] = None) -> ImageListSource:
  """VisDA-2021's validation set read from its official list (18,338 lines; label 1000 = not an ImageNet
  class, e.g. the ImageNet-O images that sit in wnid folders). ``list_file`` None: the first of
  `VISDA_LISTS` found under ``root`` (the folder the zip was unpacked in; list paths are relative to it)."""
  if list_file is None:
    found = [f for f in VISDA_LISTS if os.path.isfile(os.path.join(root, f))]
    if not found:
      raise UserError(f"{root}: no VisDA-2021 list found (expected one of {', '.join(VISDA_LISTS)}); "
                      f"name it with --image-list")
    list_file = found[0]
  return ImageListSource(root, list_file, open_set=True)


def imagenet_c_source(root: str, corruption: str, severity: int, severity_dir: Optional[str] = None
                      ) -> FolderSource:
  """Hendrycks' ImageNet-C layout: ``<root>/<corruption>/<severity>/<wnid>/*.JPEG`` (``severity_dir``: another
  name of the severity folder, e.g. ImageNet-C-bar's ``0.08``)."""
  if not os.path.isdir(root):
    raise UserError(f"{root}: data dir not found")
  if not listdir(root):
    raise UserError(f"{root}: data dir is empty")
  if not os.path.isdir(os.path.join(root, corruption)):
    raise UserError(f"{root}: corruption folder '{corruption}' not found")
  sev = os.path.join(root, corruption, severity_dir or str(severity))
  if not os.path.isdir(sev):
    raise UserError(f"{os.path.join(root, corruption)}: severity folder '{severity_dir or severity}' not found")
  return FolderSource(sev)


def parse_images_spec(spec: str, flag: str, also: str = "") -> Optional[tuple[str, str]]:
  """Checks a clean-images value (``--source-data``, ``--clean-data``) before any work: a folder
  (``<dir>/<wnid>/*.JPEG``) or ``tfds[:<name>[:<split>]]`` (default ``imagenet2012``, ``validation``).
  ``also`` names the flag's other accepted forms in the error. Returns ``(name, split)`` for TFDS, None for a
  folder."""
  if spec == "tfds" or spec.startswith("tfds:"):
    parts = spec.split(":")
    if len(parts) > 3 or any(not p for p in parts[1:]):
      raise UserError(f"{flag} {spec}: expected tfds, tfds:<name> or tfds:<name>:<split>")
    return (parts[1] if len(parts) > 1 else "imagenet2012", parts[2] if len(parts) > 2 else "validation")
  if not os.path.isdir(spec):
    forms = ["a folder", "'tfds[:<name>[:<split>]]'"] + ([also] if also else [])
    raise UserError(f"{flag} {spec}: not {', '.join(forms[:-1])} or {forms[-1]}")
  return None


def open_images(spec: str, flag: str, tfds_data_dir: Optional[str] = None):
  """The clean images of `parse_images_spec`'s ``spec`` as a source (`FolderSource` or `TFDSSource`); errors
  name ``flag``."""
  tfds_name = parse_images_spec(spec, flag)
  try:
    if tfds_name is not None:
      return TFDSSource(None, None, tfds_data_dir, name=tfds_name[0], split=tfds_name[1])
    return FolderSource(spec)
  except UserError as e:  # no class folders, no images, a folder that cannot be listed, a TFDS split typo
    raise UserError(f"{flag} {spec}: {e}") from None


def check_classes(source, num_classes: int, class_subset: Optional[Sequence[int]], where: str) -> None:
  """The labels must live in the checkpoint's head (or its class subset)."""
  if class_subset is not None:
    allowed = set(int(c) for c in class_subset)
    bad = sorted(set(np.unique(source.labels).tolist()) - allowed)
    if bad:
      raise UserError(f"{where}: {len(bad)} classes outside the {len(allowed)}-class subset (e.g. label {bad[0]})")
    return
  if source.num_label_classes != num_classes:
    kind = "ImageNet wnid folders (1000 classes)" if source.imagenet_labels else \
        f"{source.num_label_classes} class folders"
    raise UserError(f"{where}: data has {kind} but the checkpoint's head has {num_classes} classes")


def files_digest(source, indices: Sequence[int]) -> str:
  """A cheap digest of what the items ``indices`` of ``source`` would read, to tell when they changed.

  Image files (`FolderSource`, `ImageListSource`): each one's size and modification time (``os.stat``, no
  read; a missing file counts as such), so that a repaired, replaced or truncated file changes the digest; a
  copy that does not keep the times (``cp -r`` without ``-p``) changes it too. In-memory images
  (``images``, e.g. Fashion-MNIST): their bytes. TFDS: nothing more than the names and labels that callers
  digest already, as a prepared TFDS dataset is versioned and not edited in place.
  """
  h = hashlib.sha256()
  paths = getattr(source, "paths", None)
  images = getattr(source, "images", None)
  if paths is not None:
    for i in indices:
      try:
        st = os.stat(paths[int(i)])
        h.update(f"{st.st_size} {st.st_mtime_ns}\n".encode())
      except OSError:
        h.update(b"missing\n")
  elif isinstance(images, np.ndarray):
    for i in indices:
      h.update(np.ascontiguousarray(images[int(i)]).tobytes())
  return h.hexdigest()
