"""One place per dataset: what the harness and the scripts need to know about each.

A `DatasetSpec` says how to open a dataset's domains (one per corruption for
ImageNet-C and Fashion-MNIST-C, one for the others), which corruptions it has,
how its images are preprocessed, which of the model's logits it scores (the
200-class subsets of ImageNet-R/-A), and whether it holds open-set samples
(VisDA-2021's label 1000). ``get(name)`` is the registry lookup; adding a
dataset is one spec here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

import numpy as np

from pcsr_jax.data import imagenet, sources, transforms
from pcsr_jax.data.generators import corruptions, corruptions_bar
from pcsr_jax.errors import UserError

Domains = list  # [(domain name, source)]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """A dataset as the harness sees it."""

  name: str
  title: str  # for logs and plots
  open: Callable[[Any, Callable], Domains]  # (run config, log) -> domains
  preprocess: Callable[[Mapping[str, Any]], transforms.Preprocess]  # checkpoint metadata -> preprocessing
  corruptions: tuple[str, ...] = ()  # the benchmark corruptions ("all"); empty: one domain, no severity
  heldout: tuple[str, ...] = ()  # corruptions kept for tuning
  extra_domains: tuple[str, ...] = ()  # other accepted domain names (Fashion-MNIST-C's "clean")
  subset: Optional[str] = None  # a 200-class subset of the 1000 ImageNet logits (imagenet_r / imagenet_a)
  open_set: bool = False  # labels == num_classes mark samples of no known class (VisDA-2021)
  generated: bool = False  # its corrupted images are made by the project (fractional severities allowed)

  @property
  def has_severity(self) -> bool:
    return bool(self.corruptions)

  def check_corruptions(self, names) -> None:
    allowed = self.corruptions + self.heldout + self.extra_domains
    for c in names:
      if c not in allowed:
        raise UserError(f"--corruptions: unknown corruption '{c}': expected some of "
                        f"{', '.join(self.corruptions + self.heldout)}" +
                        (f" or {', '.join(self.extra_domains)}" if self.extra_domains else ""))

  def class_subset(self) -> Optional[np.ndarray]:
    return imagenet.class_subset(self.subset) if self.subset else None

  def where(self, cfg, domain: str) -> str:
    """How error messages name a domain: its folder, or the domain name for generated or TFDS data."""
    if cfg.clean_data:
      return f"--clean-data {cfg.clean_data} ({domain})"
    return f"{cfg.data}/{domain}" if self.name != "fmnist_c" and cfg.data != "tfds" else domain


def _data_dir(cfg) -> str:
  if not os.path.isdir(cfg.data):
    raise UserError(f"{cfg.data}: data dir not found")
  if not sources.listdir(cfg.data):
    raise UserError(f"{cfg.data}: data dir is empty")
  return cfg.data


def _open_imagenet_c(cfg, log) -> Domains:
  if cfg.clean_data:  # generated in the stream from clean images, the release's way
    from pcsr_jax.data.generators import generated

    clean = sources.open_images(cfg.clean_data, "--clean-data", cfg.tfds_data_dir)
    kind = generated.CleanCrops if cfg.corrupt_on == "device" else generated.CorruptedSource
    return [(c, kind(clean, c, cfg.severity, cfg.corruption_seed)) for c in cfg.corruptions]
  if cfg.data == "tfds":  # TFDS imagenet2012_corrupted, read with tfds.data_source
    return [(c, sources.TFDSSource(c, cfg.severity, cfg.tfds_data_dir)) for c in cfg.corruptions]
  return [(c, sources.imagenet_c_source(cfg.data, c, cfg.severity, _severity_dir(c, cfg.severity)))
          for c in cfg.corruptions]


def _severity_dir(corruption: str, severity: int) -> str:
  """The severity folder of a released corruption: ImageNet-C's ``1``..``5``; ImageNet-C-bar names its by
  the corruption's parameter (``make_imagenet_c_bar.py``: ``"{:.2f}"`` of the csv's value)."""
  if corruption in corruptions_bar.NAMES:
    return f"{corruptions_bar.TABLES[corruption][severity - 1]:.2f}"
  return str(severity)


def _open_fmnist_c(cfg, log) -> Domains:
  from pcsr_jax.data.generators import fmnist_c

  return fmnist_c.sources(cfg.corruptions, cfg.severity, cfg.images_per_corruption or 10000, cfg.fmnist_dir,
                          cfg.cache_dir, cfg.corruption_seed, progress=cfg.progress, log=log)


def _open_folder(cfg, log) -> Domains:
  return [(cfg.dataset, sources.FolderSource(_data_dir(cfg)))]


def _open_visda(cfg, log) -> Domains:
  return [("visda", sources.visda_source(_data_dir(cfg), cfg.image_list))]


REGISTRY: dict[str, DatasetSpec] = {s.name: s for s in (
    DatasetSpec("imagenet_c", "ImageNet-C", _open_imagenet_c, transforms.imagenet_c_preprocess,
                corruptions=imagenet.CORRUPTIONS, heldout=imagenet.HELDOUT_CORRUPTIONS,
                extra_domains=corruptions_bar.NAMES),  # ImageNet-C-bar: its folders, or generated
    DatasetSpec("imagenet_r", "ImageNet-R", _open_folder, transforms.Preprocess.from_meta, subset="imagenet_r"),
    DatasetSpec("imagenet_a", "ImageNet-A", _open_folder, transforms.Preprocess.from_meta, subset="imagenet_a"),
    DatasetSpec("visda", "VisDA-2021", _open_visda, transforms.visda_preprocess, open_set=True),
    DatasetSpec("folder", "image folder", _open_folder, transforms.Preprocess.from_meta),
    DatasetSpec("fmnist_c", "Fashion-MNIST-C", _open_fmnist_c, transforms.Preprocess.from_meta,
                corruptions=corruptions.BENCHMARK, heldout=corruptions.HELDOUT, extra_domains=("clean",),
                generated=True),
)}
NAMES = tuple(REGISTRY)


def get(name: str) -> DatasetSpec:
  if name not in REGISTRY:
    raise UserError(f"--dataset: unknown dataset '{name}': expected one of {', '.join(REGISTRY)}")
  return REGISTRY[name]
