"""NEO in PyTorch, written from its official code (``awesomealex1/NEO`` @ cd8ac01: ``tta_library/neo.py`` class
``NEO`` l. 17-46 and ``tta_library/neo_cont.py`` class ``NEO_Cont`` l. 17-44, built by ``factories.py``
``init_adapt_model`` l. 125-131, reset by ``main.py`` l. 125-126 unless ``--continual``; the forward runs under
``torch.no_grad()`` with ``adapt=True``, ``evaluator.py`` l. 53-61).

One step on a timm ViT whose head became ``nn.Identity()`` (``neo.py`` l. 7-13): ``z = model(x)`` (the pre-logit
feature), the centre moved with the batch's mean (the running mean over every sample seen, or with ``alpha`` the
EMA of ``neo_cont``), then ``head(z - centre)``. The batch is a real short batch, never padded, so the count is
``z.size(0)``; ``reset()`` zeroes the centre and the count. The ``imagenet_mask`` branch (ImageNet-R) is left
out: the agreement test's model has no class subset.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn


class Reference:
  """NEO on a timm ViT: ``step(x)`` re-centres the batch's embeddings and classifies them with the source head."""

  def __init__(self, model: nn.Module, batch_size: int, alpha: float = 0.0):
    self.classifier = model.head
    model.head = nn.Identity()  # get_vit_feature_extractor: the model now returns the pre-logit feature
    self.feature_extractor = model
    self.alpha = alpha  # 0: NEO (neo.py); > 0: NEO_Cont (neo_cont.py), its learning_rate
    self.reset()

  def reset(self) -> None:
    """``reset()`` of both classes: the centre and the count back to zero."""
    self.adapt_sample_count = 0
    w = self.classifier.weight  # get_device(): the model's device
    self.corrupt_class_center = torch.zeros(w.shape[1], device=w.device, dtype=w.dtype)

  @torch.no_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    z = self.feature_extractor(x)
    b = z.size(0)
    if self.alpha == 0.0:
      self.adapt_sample_count += b
      n = self.adapt_sample_count
      self.corrupt_class_center = (n - b) / n * self.corrupt_class_center + b / n * torch.mean(z, dim=0)
    else:
      self.corrupt_class_center = (1 - self.alpha) * self.corrupt_class_center + self.alpha * torch.mean(z, dim=0)
    return self.classifier(z - self.corrupt_class_center)

  def adapted_state(self) -> dict[str, np.ndarray]:
    """NEO adapts no parameter; its state is the centre (`center`)."""
    return {}

  def center(self) -> np.ndarray:
    return self.corrupt_class_center.numpy().copy()
