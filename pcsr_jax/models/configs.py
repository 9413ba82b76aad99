"""Architecture registry for timm-style Vision Transformers.

A `ViTConfig` holds every hyperparameter the Flax model needs. Standard timm
names (``vit_{tiny,small,base,large}_patch{16,32}_{224,384}``) resolve through
`get_config`; any other config (the project's own small ViTs, test models) is
built directly and travels in the checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pcsr_jax.errors import UserError, check_fields

# timm's widths, depths and head counts per model size.
_SIZES = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "huge": dict(embed_dim=1280, depth=32, num_heads=16),
}
_NAME_RE = re.compile(r"^vit_(tiny|small|base|large|huge)_patch(8|14|16|32)_(224|384)$")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Hyperparameters of a timm `VisionTransformer` with class-token pooling."""

  embed_dim: int
  depth: int
  num_heads: int
  patch_size: int = 16
  img_size: int = 224
  num_classes: int = 1000
  mlp_ratio: float = 4.0
  in_chans: int = 3
  name: str = "custom"

  @property
  def num_patches(self) -> int:
    return (self.img_size // self.patch_size) ** 2

  @property
  def mlp_dim(self) -> int:
    return int(self.embed_dim * self.mlp_ratio)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ViTConfig":
    check_fields(cls, d, "model config", "unexpected keys")
    return cls(**d)


def known_archs() -> list[str]:
  """All standard timm ViT names this registry resolves."""
  return [f"vit_{s}_patch{p}_{i}" for s in _SIZES for p in (16, 32) for i in (224, 384)]


def get_config(name: str, num_classes: int = 1000) -> ViTConfig:
  """Returns the config of a timm ViT name such as ``vit_base_patch16_224``."""
  m = _NAME_RE.match(name)
  if m is None:
    raise UserError(
        f"unknown arch '{name}': expected vit_<tiny|small|base|large|huge>_patch<8|14|16|32>_<224|384>, "
        f"e.g. vit_base_patch16_224")
  size, patch, img = m.group(1), int(m.group(2)), int(m.group(3))
  return ViTConfig(**_SIZES[size], patch_size=patch, img_size=img, num_classes=num_classes, name=name)


def heads_for_width(embed_dim: int) -> int | None:
  """timm's head count for a standard width (head dim 64), None if not standard."""
  for s in _SIZES.values():
    if s["embed_dim"] == embed_dim:
      return s["num_heads"]
  return None


def arch_name(embed_dim: int, depth: int, patch_size: int, img_size: int) -> str | None:
  """Inverse of `get_config`: the timm name of a standard shape, else None."""
  for size, s in _SIZES.items():
    if s["embed_dim"] == embed_dim and s["depth"] == depth:
      name = f"vit_{size}_patch{patch_size}_{img_size}"
      return name if _NAME_RE.match(name) else None
  return None


def default_preprocessing(img_size: int) -> dict[str, Any]:
  """timm's pretrained config for the augreg ViT weights.

  mean = std = 0.5 (not the ImageNet statistics SAR's code used; see the
  normalization trap in docs/weights.md), bicubic, crop_pct 0.9 at 224 px and 1.0 at
  384 px.
  """
  return dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bicubic",
              crop_pct=0.9 if img_size < 384 else 1.0)
