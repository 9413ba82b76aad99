"""Test streams of the online TTA settings (reference-protocols.md, Sec. 5).

A stream is a list of `Segment`s; the engine resets the model to the source
state before a segment with ``reset=True``. Items are ``(source_id, index)``
pairs, ``source_id`` indexing the per-corruption sources.

* ``normal`` -- each corruption on its own, shuffled, fresh source model each.
* ``continual`` -- the corruptions in order, each shuffled, one model, no reset.
* ``mix_shifts`` -- all corruptions concatenated and shuffled together, one model.
* ``label_shifts`` -- per corruption, SAR's class-phase sampler (`label_shift_indices`)
  or a SAR index file; not shuffled afterwards (the order *is* the shift).
* ``bs1`` -- ``normal`` at batch size 1.
* ``gradual`` -- the continual setting with the severity walked 1 -> 5 -> 1 within each corruption
  (`GRADUAL`: 9 passes over its images, each shuffled on its own), one model, no reset: the "gradual" setting
  of RMT (Doebler et al., CVPR 2023; the test-time-adaptation repository's ``gradual``), which resets only
  before the first corruption. Its sources are the corruptions at severities 1..5 (`gradual_domain`).
* ``ccc`` -- CCC's continuously changing corruptions (`pcsr_jax.ccc_stream`): one source whose order is the
  walk, streamed as it is (never shuffled), one model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from pcsr_jax.errors import UserError

SETTINGS = ("normal", "continual", "mix_shifts", "label_shifts", "bs1", "gradual", "ccc")
GRADUAL = (1, 2, 3, 4, 5, 4, 3, 2, 1)  # severities of each corruption in turn (RMT's gradual setting)
SEVERITIES = (1, 2, 3, 4, 5)


def gradual_domain(corruption: str, severity: int) -> str:
  """The domain name of one corruption at one severity in the gradual setting."""
  return f"{corruption}@{severity}"


def split_domain(name: str, severity: float) -> tuple[str, float]:
  """``(corruption, severity)`` of a domain name: `gradual_domain`'s, or a plain name at ``severity``."""
  if "@" in name:
    corruption, sev = name.rsplit("@", 1)
    return corruption, int(sev)
  return name, severity


@dataclasses.dataclass
class Segment:
  name: str  # corruption name, or "mix"
  source_ids: np.ndarray
  indices: np.ndarray
  reset: bool


def label_shift_indices(labels: np.ndarray, rng: np.random.Generator, imbalance_ratio: float = 500000.0,
                        steps_per_class: int = 100) -> np.ndarray:
  """SAR's online label-shift sampler over whatever classes ``labels`` holds.

  K classes in a shuffled order pi; phase i (``steps_per_class`` draws) draws
  class pi(i) with probability ir / (ir + K - 1) and every other class with
  1 / (ir + K - 1); within a class, images uniformly with replacement. Returns
  ``K * steps_per_class`` indices into ``labels`` (100,000 for ImageNet-C).
  """
  classes = np.unique(labels)
  k = len(classes)
  by_class = [np.flatnonzero(labels == c) for c in classes]
  order = rng.permutation(k)
  out = np.empty(k * steps_per_class, np.int64)
  for phase, favoured in enumerate(order):
    p = np.full(k, 1.0 / (imbalance_ratio + k - 1))
    p[favoured] = imbalance_ratio / (imbalance_ratio + k - 1)
    cls = rng.choice(k, size=steps_per_class, p=p / p.sum())
    for j, c in enumerate(cls):
      out[phase * steps_per_class + j] = by_class[c][rng.integers(len(by_class[c]))]
  return out


def load_index_file(path: str, n: int) -> np.ndarray:
  """A SAR label-shift index file: float64 .npy of indices into the n images of one corruption."""
  try:
    raw = np.load(path, allow_pickle=False)
  except Exception as e:
    raise UserError(f"{path}: not a readable .npy index file ({type(e).__name__})") from None
  if raw.ndim != 1 or raw.size == 0 or not np.all(np.isfinite(raw)) or np.any(raw != np.round(raw)):
    raise UserError(f"{path}: expected a 1-D array of integer-valued indices")
  idx = raw.astype(np.int64)
  if idx.min() < 0 or idx.max() >= n:
    raise UserError(f"{path}: indices must lie in [0, {n}), found [{idx.min()}, {idx.max()}]")
  return idx


def build(setting: str, sizes: Sequence[int], labels: Sequence[np.ndarray], names: Sequence[str], seed: int,
          shuffle: bool = True, imbalance_ratio: float = 500000.0,
          index_file: Optional[str] = None) -> list[Segment]:
  """The segments of ``setting`` over sources of the given sizes (one per corruption, in order)."""
  if setting not in SETTINGS:
    raise UserError(f"unknown setting '{setting}': expected one of {', '.join(SETTINGS)}")
  rng = np.random.default_rng(seed)

  def order(n: int) -> np.ndarray:
    return rng.permutation(n) if shuffle else np.arange(n)

  ids = lambda sid, idx: np.full(len(idx), sid, np.int32)
  if setting == "ccc":  # the walk's order is the stream
    return [Segment(names[0], ids(0, np.arange(sizes[0])), np.arange(sizes[0]), reset=True)]
  if setting == "gradual":
    # The sources come as `gradual_domain(c, s)` for s in 1..5, corruption after corruption.
    index = {name: sid for sid, name in enumerate(names)}
    corruptions = list(dict.fromkeys(split_domain(n, 0)[0] for n in names))
    segs = []
    for c in corruptions:
      for sev in GRADUAL:
        sid = index[gradual_domain(c, sev)]
        idx = order(sizes[sid])
        segs.append(Segment(names[sid], ids(sid, idx), idx, reset=not segs))
    return segs
  if setting in ("normal", "bs1", "continual"):
    segs = []
    for sid, (n, name) in enumerate(zip(sizes, names)):
      idx = order(n)
      segs.append(Segment(name, ids(sid, idx), idx, reset=(setting != "continual" or sid == 0)))
    return segs
  if setting == "mix_shifts":
    sid = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(sizes)])
    idx = np.concatenate([np.arange(n) for n in sizes])
    perm = order(len(idx))
    return [Segment("mix", sid[perm], idx[perm], reset=True)]
  segs = []
  for sid, (n, lab, name) in enumerate(zip(sizes, labels, names)):
    idx = load_index_file(index_file, n) if index_file else label_shift_indices(lab, rng, imbalance_ratio)
    segs.append(Segment(name, ids(sid, idx), idx, reset=True))
  return segs
