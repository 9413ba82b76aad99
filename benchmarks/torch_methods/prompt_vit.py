"""The official ``PromptViT`` of FOA's code (``models/vpt.py``), which FOZO's code reuses: a timm ViT with prompt
tokens after the class token, and the class token of every layer normalised by the next block's norm1 (the last
by the final norm)."""

from __future__ import annotations

from typing import Optional

import torch


def layers_cls_features(vit, x: torch.Tensor, prompts: Optional[torch.Tensor]) -> list[torch.Tensor]:
  """``PromptViT.layers_cls_features(_with_prompts)``: one ``[B, D]`` tensor per layer (``prompts`` ``[1, P, D]``
  or None)."""
  x = vit._pos_embed(vit.patch_embed(x))
  if prompts is not None:
    x = torch.cat((x[:, :1, :], prompts.expand(x.shape[0], -1, -1), x[:, 1:, :]), dim=1)
  x = vit.norm_pre(x)
  feats = []
  for i, blk in enumerate(vit.blocks):
    x = blk(x)
    feats.append((vit.blocks[i + 1].norm1 if i < len(vit.blocks) - 1 else vit.norm)(x[:, 0]))
  return feats
