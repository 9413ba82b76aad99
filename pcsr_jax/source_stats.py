"""Statistics of clean source data (EATA's Fisher, CFA's moments, FOA's feature mean/std), computed once and cached.

Some methods need a pass over clean source images before adapting (`Method.source_data`). This module opens
that data (``--source-data``), picks the images the method's official code uses (`Method.source_images`:
EATA's 2,000 random images, all of them for CFA and FOA), runs the method's `Method.compute_source_stats` with
a progress bar, and caches the result next to the checkpoint::

    <checkpoint>.source_stats/<method key>-<digest>.npz    the arrays
    <checkpoint>.source_stats/<method key>-<digest>.json   what they were computed from, what was read, and
                                                           the npz's SHA-256

The digest (`describe`, `key`) covers everything the numbers depend on that is known before reading: the
checkpoint's params, the chosen images (names and labels, in order) and their files' sizes and modification
times (`sources.files_digest`: a repaired, replaced or truncated image is another entry, at the cost of one
``os.stat`` per image; a copy of the folder that does not keep the times computes the statistics once more),
their preprocessing, the batch size, the method's statistics key and this module's version. What was read is
recorded as the statistics are computed: the images used, the unreadable ones left out (counted, the first
few named, in the log and in every record), and a digest of the decoded uint8 pixels of those used. A cache
entry is used only if its JSON, its checksum and its arrays' keys, shapes and dtypes (against
`Method.source_stats_shapes`) all match; otherwise it is rebuilt, and the log says why. Where the
checkpoint's folder is not writable the cache goes to the run's output folder.

``--source-data`` accepts a clean ImageNet folder (``<dir>/<wnid>/*.JPEG``: the validation or the training
set), ``tfds`` or ``tfds:<name>[:<split>]`` (default ``imagenet2012``, ``validation``) read with
``tfds.data_source``, or ``fmnist-train`` (the Fashion-MNIST training set: the built-in benchmark's source).
A method that reads the labels (CFA) needs them to be the checkpoint's classes (`check_labels`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from pcsr_jax import checkpoint, files, methods
from pcsr_jax.data import sources, transforms
from pcsr_jax.data.loader import Loader
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, split

VERSION = 2  # bump when the way statistics are computed changes: every cache entry is then rebuilt
SELECTION_SEED = 0  # which random images a method with `source_images` uses (EATA: 2,000 of the set)


@dataclasses.dataclass
class SourceData:
  """Clean source images: a random-access source (``labels``, ``names``, ``load``) and its preprocessing."""

  spec: str  # the --source-data value
  description: str
  source: Any
  preprocess: transforms.Preprocess


def open_source_data(spec: str, meta: Mapping[str, Any], tfds_data_dir: Optional[str] = None,
                     fmnist_dir: Optional[str] = None) -> SourceData:
  """Opens ``--source-data``; ImageNet images get Resize(256) + CenterCrop(224) (EATA's and FOA's source
  loaders), i.e. the checkpoint's preprocessing at crop 0.875."""
  if spec == "fmnist-train":
    from pcsr_jax.data import fashion_mnist
    from pcsr_jax.data.generators import fmnist_c

    images, labels = fashion_mnist.load("train", fmnist_dir)
    src = fmnist_c.ArraySource(images, labels, len(fashion_mnist.CLASSES))
    src.names = [f"train_{i:05d}" for i in range(len(images))]
    return SourceData(spec, f"Fashion-MNIST train ({len(src):,} images)", src, transforms.Preprocess.from_meta(meta))
  preprocess = transforms.Preprocess.from_meta(meta, crop_pct=0.875)
  src = sources.open_images(spec, "--source-data", tfds_data_dir)
  if isinstance(src, sources.TFDSSource):
    return SourceData(spec, f"tfds {src.config} {src.split} ({len(src):,} images)", src, preprocess)
  return SourceData(spec, f"folder {spec} ({len(src):,} images)", src, preprocess)


def check_spec(spec: str) -> Optional[tuple[str, str]]:
  """Checks a ``--source-data`` value before any work; returns ``(name, split)`` for a TFDS one."""
  if spec == "fmnist-train":
    return None
  return sources.parse_images_spec(spec, "--source-data", also="'fmnist-train'")


def select(method: Method, data: SourceData, limit: Optional[int] = None) -> np.ndarray:
  """Indices of the images ``method``'s statistics use: ``method.source_images`` random ones (seeded), or all;
  ``limit`` caps the count (``--source-images``; the records say so)."""
  n = len(data.source)
  want = method.source_images
  if limit is not None:
    want = limit if want is None else min(want, limit)
  if want is None or want >= n:
    return np.arange(n)
  return np.random.default_rng(SELECTION_SEED).permutation(n)[:want]



def check_labels(method: Method, data: SourceData, num_classes: int) -> None:
  """A method that reads the source labels (CFA: per-class feature means) needs them in the checkpoint's head,
  checked as the test data's are (`sources.check_classes`): a folder of 3 class folders is not ImageNet's
  classes 0-2. Methods that ignore the labels (EATA, FOA) take any folder of images."""
  if method.source_labels:
    sources.check_classes(data.source, num_classes, None, f"--source-data {data.spec} (for {method.name})")


def describe(method: Method, data: SourceData, batch_size: int, ckpt_digest: str,
             limit: Optional[int] = None) -> tuple[np.ndarray, dict]:
  """``(indices, description)``: the images ``method``'s statistics use and everything the statistics depend
  on that can be known without reading them; its `key` names the cache entry, and `harness` keeps it to
  refuse a ``--resume`` whose source statistics would differ. The images' bytes enter as the cheap
  `sources.files_digest` (file sizes and modification times; the bytes of in-memory images)."""
  indices = select(method, data, limit)
  h = hashlib.sha256()
  for i in indices:
    h.update(f"{data.source.names[i]}\t{int(data.source.labels[i])}\n".encode())
  return indices, dict(version=VERSION, method=method.stats_key(), checkpoint_params=ckpt_digest,
                       source_data=data.description, images=int(len(indices)), images_digest=h.hexdigest(),
                       files_digest=sources.files_digest(data.source, indices),
                       preprocess=dataclasses.asdict(data.preprocess), batch_size=batch_size,
                       labels=method.source_labels)


def key(desc: dict) -> str:
  """The cache entry's name for a `describe` description."""
  return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]



def cache_dir_for(checkpoint_dir: str, fallback: str) -> str:
  """``<checkpoint>.source_stats`` if it can be written, else ``<fallback>/source_stats``."""
  d = os.path.abspath(checkpoint_dir).rstrip(os.sep) + ".source_stats"
  try:
    os.makedirs(d, exist_ok=True)
    probe = os.path.join(d, f".write_test_{socket.gethostname()}_{os.getpid()}")  # unique across hosts
    open(probe, "w").close()
    os.remove(probe)
    return d
  except OSError:
    d = os.path.join(fallback, "source_stats")
    os.makedirs(d, exist_ok=True)
    return d


def _mismatch(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, jax.ShapeDtypeStruct]) -> str:
  """What differs between ``arrays`` and the declared ``shapes`` ("" if nothing)."""
  if set(arrays) != set(shapes):
    odd = sorted(set(arrays) ^ set(shapes))
    return f"arrays {', '.join(odd[:3])} {'missing' if odd[0] in shapes else 'unexpected'}"
  for k, s in shapes.items():
    a = arrays[k]
    if a.shape != tuple(s.shape) or a.dtype != np.dtype(s.dtype):
      return f"{k} is {a.dtype.name}{list(a.shape)}, the method computes {np.dtype(s.dtype).name}{list(s.shape)}"
  return ""


def load_cached(path: str, desc: dict, shapes: Optional[Mapping[str, jax.ShapeDtypeStruct]] = None
                ) -> tuple[Optional[dict], Optional[dict], str]:
  """``(arrays, what was read, "")`` for a valid cache entry, else ``(None, None, why not)``. ``shapes``: what
  the method computes (`Method.source_stats_shapes`); arrays of other keys, shapes or dtypes are refused."""
  npz, meta_path = path + ".npz", path + ".json"
  if not (os.path.isfile(npz) and os.path.isfile(meta_path)):
    return None, None, "not computed yet"
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None, None, f"{meta_path} unreadable"
  if not isinstance(meta, dict) or not isinstance(meta.get("read"), dict):
    return None, None, f"{meta_path} is not a statistics description"
  if meta.get("describe") != json.loads(json.dumps(desc)):
    return None, None, "computed from another checkpoint, data or version"
  if meta.get("sha256") != files.sha256(npz):
    return None, None, f"{npz} does not match its checksum (edited or truncated)"
  try:
    with np.load(npz) as z:
      arrays = {k: z[k] for k in z.files}
  except (OSError, ValueError) as e:
    return None, None, f"{npz} unreadable ({type(e).__name__})"
  why = _mismatch(arrays, shapes) if shapes is not None else ""
  if why:
    return None, None, f"{npz}: {why}"
  return arrays, meta["read"], ""


def _save(path: str, arrays: dict, desc: dict, read: dict) -> None:
  with files.atomic_path(path + ".npz") as tmp:
    np.savez(tmp, **arrays)
  files.write_json(path + ".json", dict(describe=desc, read=read, sha256=files.sha256(path + ".npz")), indent=1)


SKIPPED_NAMED = 5  # how many unreadable source images the logs and records name


def compute(method: Method, model: Any, params: Any, data: SourceData, indices: np.ndarray, batch_size: int,
            workers: Optional[int] = None, progress: bool = True,
            prep: Optional[Prepared] = None) -> tuple[dict[str, np.ndarray], dict]:
  """Runs ``method.compute_source_stats`` over the chosen images (decoded in a thread pool, with a bar);
  ``prep``: the method's `Method.prepare` for ``model``, ``params`` and ``batch_size``, if at hand.

  Returns the arrays and what was read: ``images`` (read), ``skipped`` (unreadable: left out, as in the
  stream), ``skipped_names`` (the first few) and ``content_sha256``, a digest of every read image's name and
  decoded uint8 pixels in order. `UserError` when no image could be read."""
  from tqdm import tqdm

  prep = prep or method.prepare(model, params, jax.random.key(0), batch_size)
  frozen, trainable = split(prep.params, prep.is_trainable)
  loader = Loader([data.source], data.preprocess.to_uint8, batch_size, workers=workers)
  bar = tqdm(total=len(indices), desc=f"{method.name} source statistics", unit="img",
             disable=not (progress and sys.stderr.isatty()), file=sys.stderr)
  content, used, skipped = hashlib.sha256(), [0], []

  def batches():
    for b in loader.batches(np.zeros(len(indices), np.int64), indices):
      bar.update(len(b.labels) + len(b.skipped))
      skipped.extend(b.skipped)
      for name, img in zip(b.names, b.images):
        content.update(f"{name}\n".encode() + hashlib.sha256(np.ascontiguousarray(img).tobytes()).digest())
      if len(b.labels):
        used[0] += len(b.labels)
        # `compute_source_stats` takes normalized float32 (host arrays): the same arithmetic as `Preprocess`.
        yield data.preprocess.normalize(b.images), b.labels.astype(np.int32)
    if not used[0]:  # raised into the method's loop: one line, not its division by zero
      raise UserError(f"--source-data {data.spec}: none of the {len(indices):,} source images {method.name} uses "
                      f"could be read (e.g. {', '.join(skipped[:SKIPPED_NAMED])})")

  try:
    out = method.compute_source_stats(prep, frozen, trainable, batches())
  finally:
    bar.close()
  read = dict(images=used[0], skipped=len(skipped), skipped_names=skipped[:SKIPPED_NAMED],
              content_sha256=content.hexdigest())
  return {k: np.asarray(v) for k, v in out.items()}, read


def used_note(desc: dict) -> str:
  """What the records say about the source data of statistics described by `get`: images used, and the
  unreadable ones skipped (with the first names)."""
  read = desc["read"]
  note = f"{read['images']:,} images of {desc['source_data']}"
  if read["skipped"]:
    note += (f" ({read['skipped']:,} of {desc['images']:,} unreadable, skipped: "
             f"{', '.join(read['skipped_names'])}{', ...' if read['skipped'] > len(read['skipped_names']) else ''})")
  return note


def get(method: Method, model: Any, params: Any, data: SourceData, *, checkpoint_dir: str, output_dir: str,
        batch_size: int, limit: Optional[int] = None, workers: Optional[int] = None, progress: bool = True,
        log: Callable = print, ckpt_digest: Optional[str] = None,
        described: Optional[tuple[np.ndarray, dict]] = None) -> tuple[dict[str, np.ndarray], dict]:
  """The method's statistics (from the cache, or computed and cached) and what they were computed from: the
  `describe` description (pass ``described`` when it is at hand) plus ``read`` (`compute`'s account)."""
  indices, desc = described or describe(method, data, batch_size, ckpt_digest or checkpoint.params_digest(params), limit)
  path = os.path.join(cache_dir_for(checkpoint_dir, output_dir), f"{method.stats_key()}-{key(desc)}")
  prep = method.prepare(model, params, jax.random.key(0), batch_size)
  shapes = method.source_stats_shapes(prep, *split(prep.params, prep.is_trainable))
  arrays, read, why = load_cached(path, desc, shapes)
  if arrays is not None:
    full = dict(desc, read=read)
    log(f"{method.name}: source statistics from {path}.npz ({used_note(full)})")
    return arrays, full
  log(f"{method.name}: computing source statistics over {len(indices):,} images of {data.description} ({why})")
  arrays, read = compute(method, model, params, data, indices, batch_size, workers, progress, prep)
  if _mismatch(arrays, shapes):  # a bug in the method, which would rebuild its cache on every run
    raise RuntimeError(f"{method.name}: compute_source_stats and source_stats_shapes disagree: "
                       f"{_mismatch(arrays, shapes)}")
  full = dict(desc, read=read)
  if read["skipped"]:
    log(f"{method.name}: {read['skipped']:,} of {len(indices):,} source images could not be read and were left "
        f"out (e.g. {', '.join(read['skipped_names'])})")
  bad = [k for k, v in arrays.items() if not np.all(np.isfinite(v))]
  if bad:
    raise UserError(f"{method.name}: source statistics {bad[0]} are not finite (check --source-data)")
  _save(path, arrays, desc, read)
  log(f"{method.name}: source statistics saved to {path}.npz")
  return arrays, full


def needs(method_name: str, method_args: Mapping[str, dict]) -> bool:
  return methods.get(method_name, **method_args.get(method_name, {})).uses_source_data()
