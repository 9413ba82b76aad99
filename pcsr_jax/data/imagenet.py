"""ImageNet label space: the 1000 wnids in sorted order (timm's head order), the 200-class subsets of
ImageNet-R and ImageNet-A, and the ImageNet-C corruption names."""

from __future__ import annotations

import functools
import os

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))

CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
               "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
               "jpeg_compression")
HELDOUT_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
SHORT_NAMES = dict(zip(CORRUPTIONS, ("gaus", "shot", "impul", "defcs", "gls", "mtn", "zm", "snw", "frst", "fg",
                                     "brt", "cnt", "els", "px", "jpg")))
SHORT_NAMES.update(speckle_noise="spckl", gaussian_blur="gblur", spatter="sptr", saturate="sat")


@functools.lru_cache(maxsize=None)
def wnids(name: str = "imagenet1k") -> tuple[str, ...]:
  """Sorted wnids of ``imagenet1k`` (1000), ``imagenet_r`` or ``imagenet_a`` (200 each)."""
  with open(os.path.join(_HERE, f"{name}_wnids.txt")) as f:
    return tuple(f.read().split())


def class_subset(name: str) -> np.ndarray:
  """Indices into the 1000 ImageNet classes of a 200-class subset (``imagenet_r`` / ``imagenet_a``)."""
  index = {w: i for i, w in enumerate(wnids())}
  return np.asarray([index[w] for w in wnids(name)], np.int32)
