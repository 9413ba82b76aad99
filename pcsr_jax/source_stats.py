"""Statistics of clean source data (EATA's Fisher, CFA's moments, FOA's feature mean/std), computed once and cached.

Some methods need a pass over clean source images before adapting (`Method.source_data`). This module opens
that data (``--source-data``), picks the images the method's official code uses (`Method.source_images`:
EATA's 2,000 random images, all of them for CFA and FOA), runs the method's `Method.compute_source_stats` with
a progress bar, and caches the result next to the checkpoint::

    <checkpoint>.source_stats/<method key>-<digest>.npz    the arrays
    <checkpoint>.source_stats/<method key>-<digest>.json   what they were computed from, and the npz's SHA-256

The digest covers everything the numbers depend on: the checkpoint's params, the chosen images (names and
labels, in order), their preprocessing, the batch size, the method's statistics key and this module's
version. A cache whose JSON or checksum does not match (stale, edited, truncated) is rebuilt, and the log
says why. Where the checkpoint's folder is not writable the cache goes to the run's output folder.

``--source-data`` accepts a clean ImageNet folder (``<dir>/<wnid>/*.JPEG``: the validation or the training
set), ``tfds`` or ``tfds:<name>[:<split>]`` (default ``imagenet2012``, ``validation``) read with
``tfds.data_source``, or ``fmnist-train`` (the Fashion-MNIST training set: the built-in benchmark's source).
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

from pcsr_jax import files, methods
from pcsr_jax.data import sources, transforms
from pcsr_jax.data.loader import Loader
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, split

VERSION = 1  # bump when the way statistics are computed changes: every cache entry is then rebuilt
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
    from pcsr_jax.data import fashion_mnist, fmnist_c

    images, labels = fashion_mnist.load("train", fmnist_dir)
    src = fmnist_c.ArraySource(images, labels, len(fashion_mnist.CLASSES))
    src.names = [f"train_{i:05d}" for i in range(len(images))]
    return SourceData(spec, f"Fashion-MNIST train ({len(src):,} images)", src, transforms.Preprocess.from_meta(meta))
  preprocess = transforms.Preprocess.from_meta(meta, crop_pct=0.875)
  tfds_name = check_spec(spec)
  if tfds_name is not None:
    name, split_name = tfds_name
    src = sources.TFDSSource(None, None, tfds_data_dir, name=name, split=split_name)
    return SourceData(spec, f"tfds {name} {split_name} ({len(src):,} images)", src, preprocess)
  src = sources.FolderSource(spec)
  return SourceData(spec, f"folder {spec} ({len(src):,} images)", src, preprocess)


def check_spec(spec: str) -> Optional[tuple[str, str]]:
  """Checks a ``--source-data`` value before any work; returns ``(name, split)`` for a TFDS one."""
  if spec == "fmnist-train":
    return None
  if spec == "tfds" or spec.startswith("tfds:"):
    parts = spec.split(":")
    if len(parts) > 3 or any(not p for p in parts[1:]):
      raise UserError(f"--source-data {spec}: expected tfds, tfds:<name> or tfds:<name>:<split>")
    return (parts[1] if len(parts) > 1 else "imagenet2012", parts[2] if len(parts) > 2 else "validation")
  if not os.path.isdir(spec):
    raise UserError(f"--source-data {spec}: not a folder, 'tfds[:<name>[:<split>]]' or 'fmnist-train'")
  return None


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


def params_digest(params: Any) -> str:
  """SHA-256 over the checkpoint's params (names, shapes, bytes)."""
  from flax import traverse_util

  h = hashlib.sha256()
  for k, v in sorted(traverse_util.flatten_dict(params).items()):
    a = np.ascontiguousarray(np.asarray(v, np.float32))
    h.update(f"{'/'.join(k)}:{a.shape}\n".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _describe(method: Method, data: SourceData, indices: np.ndarray, ckpt_digest: str, batch_size: int) -> dict:
  h = hashlib.sha256()
  for i in indices:
    h.update(f"{data.source.names[i]}\t{int(data.source.labels[i])}\n".encode())
  return dict(version=VERSION, method=method.stats_key(), checkpoint_params=ckpt_digest,
              source_data=data.description, images=int(len(indices)), images_digest=h.hexdigest(),
              preprocess=dataclasses.asdict(data.preprocess), batch_size=batch_size, labels=method.source_labels)


def _file_sha(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


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


def load_cached(path: str, desc: dict) -> tuple[Optional[dict], str]:
  """``(arrays, "")`` for a valid cache entry, else ``(None, why not)``."""
  npz, meta_path = path + ".npz", path + ".json"
  if not (os.path.isfile(npz) and os.path.isfile(meta_path)):
    return None, "not computed yet"
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None, f"{meta_path} unreadable"
  if meta.get("describe") != json.loads(json.dumps(desc)):
    return None, "computed from another checkpoint, data or version"
  if meta.get("sha256") != _file_sha(npz):
    return None, f"{npz} does not match its checksum (edited or truncated)"
  try:
    with np.load(npz) as z:
      return {k: z[k] for k in z.files}, ""
  except (OSError, ValueError) as e:
    return None, f"{npz} unreadable ({type(e).__name__})"


def _save(path: str, arrays: dict, desc: dict) -> None:
  with files.atomic_path(path + ".npz") as tmp:
    np.savez(tmp, **arrays)
  files.write_json(path + ".json", dict(describe=desc, sha256=_file_sha(path + ".npz")), indent=1)


def compute(method: Method, model: Any, params: Any, data: SourceData, indices: np.ndarray, batch_size: int,
            workers: Optional[int] = None, progress: bool = True) -> dict[str, np.ndarray]:
  """Runs ``method.compute_source_stats`` over the chosen images (decoded in a thread pool, with a bar)."""
  from tqdm import tqdm

  prep = method.prepare(model, params, jax.random.key(0), batch_size)
  frozen, trainable = split(prep.params, prep.is_trainable)
  loader = Loader([data.source], data.preprocess.to_uint8, batch_size, workers=workers)
  bar = tqdm(total=len(indices), desc=f"{method.name} source statistics", unit="img",
             disable=not (progress and sys.stderr.isatty()), file=sys.stderr)

  def batches():
    for b in loader.batches(np.zeros(len(indices), np.int64), indices):
      bar.update(len(b.labels) + len(b.skipped))
      if len(b.labels):
        # `compute_source_stats` takes normalized float32 (host arrays): the same arithmetic as `Preprocess`.
        yield data.preprocess.normalize(b.images), b.labels.astype(np.int32)

  try:
    out = method.compute_source_stats(prep, frozen, trainable, batches())
  finally:
    bar.close()
  return {k: np.asarray(v) for k, v in out.items()}


def get(method: Method, model: Any, params: Any, data: SourceData, *, checkpoint_dir: str, output_dir: str,
        batch_size: int, limit: Optional[int] = None, workers: Optional[int] = None, progress: bool = True,
        log: Callable = print, ckpt_digest: Optional[str] = None) -> tuple[dict[str, np.ndarray], dict]:
  """The method's statistics (from the cache, or computed and cached) and what they were computed from."""
  indices = select(method, data, limit)
  desc = _describe(method, data, indices, ckpt_digest or params_digest(params), batch_size)
  digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
  path = os.path.join(cache_dir_for(checkpoint_dir, output_dir), f"{method.stats_key()}-{digest}")
  arrays, why = load_cached(path, desc)
  if arrays is not None:
    log(f"{method.name}: source statistics from {path}.npz ({desc['images']:,} images of {data.description})")
    return arrays, desc
  log(f"{method.name}: computing source statistics over {len(indices):,} images of {data.description} ({why})")
  arrays = compute(method, model, params, data, indices, batch_size, workers, progress)
  bad = [k for k, v in arrays.items() if not np.all(np.isfinite(v))]
  if bad:
    raise UserError(f"{method.name}: source statistics {bad[0]} are not finite (check --source-data)")
  _save(path, arrays, desc)
  log(f"{method.name}: source statistics saved to {path}.npz")
  return arrays, desc


def needs(method_name: str, method_args: Mapping[str, dict]) -> bool:
  return methods.get(method_name, **method_args.get(method_name, {})).uses_source_data()
