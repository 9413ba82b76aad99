"""T3A in PyTorch, written as its official code (``matsuolab/T3A:domainbed/adapt_algorithms.py``, ViT port
``mr-eggplant/FOA:tta_library/t3a.py``): growing support tensors, re-selected by a per-class sort.

The one change: ``torch.sort(..., stable=True)``, so that exact entropy ties keep their concatenation order
(the tie rule `pcsr_jax.methods.t3a` documents); the official default leaves their order unspecified.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
  return -(x.softmax(1) * x.log_softmax(1)).sum(1)


class Reference:
  """T3A on a timm ViT: ``step(x)`` adds the batch to the supports, then predicts with the prototypes."""

  def __init__(self, model: nn.Module, batch_size: int, filter_k: int = 20):
    self.classifier = model.head
    model.head = nn.Identity()  # FOA's get_vit_featurer: the model now returns the pre-logit feature
    self.featurizer = model
    self.filter_k = filter_k
    self.num_classes = self.classifier.out_features
    with torch.no_grad():
      self.supports = self.classifier.weight.data.clone()
      warmup = self.classifier(self.supports)
      self.labels = F.one_hot(warmup.argmax(1), num_classes=self.num_classes).float()
      self.ent = softmax_entropy(warmup)

  @torch.no_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    z = self.featurizer(x)
    p = self.classifier(z)
    self.supports = torch.cat([self.supports, z])
    self.labels = torch.cat([self.labels, F.one_hot(p.argmax(1), num_classes=self.num_classes).float()])
    self.ent = torch.cat([self.ent, softmax_entropy(p)])
    supports, labels = self._select_supports()
    weights = F.normalize(supports, dim=1).T @ labels
    return z @ F.normalize(weights, dim=0)

  def _select_supports(self):
    y_hat = self.labels.argmax(dim=1)
    all_idx = torch.arange(len(self.ent), device=self.ent.device)
    keep = []
    for c in range(self.num_classes):
      _, order = torch.sort(self.ent[y_hat == c], stable=True)
      keep.append(all_idx[y_hat == c][order][: self.filter_k])
    keep = torch.cat(keep)
    self.supports, self.labels, self.ent = self.supports[keep], self.labels[keep], self.ent[keep]
    return self.supports, self.labels

  def adapted_state(self) -> dict[str, np.ndarray]:
    """T3A adapts no parameter."""
    return {}
