"""ROID in PyTorch, written as DT's ``classification/methods/roid.py`` runs it on a timm ViT.

``loss_calculation`` / ``forward_and_adapt`` as the official: weights under ``no_grad``, the mask
``w_div < mean``, SLR and symmetric CE summed over the kept samples and divided by the configured batch
size, Nesterov SGD over every LayerNorm's weight and bias, ``ema_update_model`` towards a detached
source copy, and the in-place prior correction of the returned logits.

The augmented views are injectable: ``views`` is an iterable of NCHW normalised batches, one per step, with
a view for *every* sample; the reference takes the kept rows, as the official augments ``imgs_test[~mask]``
(its draw is shared by the batch, so this is the same as augmenting the kept rows alone). Without it, the
official ``get_tta_transforms(img_size, padding_mode="reflect", cotta_augs=False)`` (written below with
torchvision) augments the kept images, un-normalised with ``mean``/``std`` (DT's models normalise inside).
"""

from __future__ import annotations

import copy
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class ColorJitterPro(nn.Module):
  """DT's ``ColorJitterPro``: brightness, contrast, saturation, hue and gamma in a random order, one draw
  for the whole tensor; clamped to [1e-8, 1] right before gamma."""

  def __init__(self, brightness=(0.6, 1.4), contrast=(0.7, 1.3), saturation=(0.5, 1.5), hue=(-0.06, 0.06),
               gamma=(0.7, 1.3)):
    super().__init__()
    self.ranges = (brightness, contrast, saturation, hue, gamma)

  def forward(self, img: torch.Tensor) -> torch.Tensor:
    import torchvision.transforms.functional as TF

    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue,
           lambda x, g: TF.adjust_gamma(x.clamp(1e-8, 1.0), g))
    for i in torch.randperm(5).tolist():
      lo, hi = self.ranges[i]
      img = ops[i](img, torch.tensor(1.0).uniform_(lo, hi).item())
    return img


def tta_transform(n_pixels: int) -> nn.Module:
  """DT ``get_tta_transforms(img_size, padding_mode="reflect", cotta_augs=False)``."""
  import torchvision.transforms as T

  clip = T.Lambda(lambda x: x.clamp(0.0, 1.0))
  return T.Compose([
      clip, ColorJitterPro(), T.Pad(n_pixels // 2, padding_mode="reflect"),
      T.RandomAffine(degrees=(-15, 15), translate=(1 / 16, 1 / 16), scale=(0.9, 1.1),
                     interpolation=T.InterpolationMode.BILINEAR, fill=0),
      T.CenterCrop(n_pixels), T.RandomHorizontalFlip(0.5), clip])


def entropy(logits: torch.Tensor) -> torch.Tensor:
  return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def symmetric_cross_entropy(x: torch.Tensor, x_ema: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
  return (-(1 - alpha) * (x_ema.softmax(1) * x.log_softmax(1)).sum(1)
          - alpha * (x.softmax(1) * x_ema.log_softmax(1)).sum(1))


def soft_likelihood_ratio(logits: torch.Tensor, clip: float = 0.99, eps: float = 1e-5) -> torch.Tensor:
  probs = torch.clamp(logits.softmax(1), min=0.0, max=clip)
  return -(probs * torch.log(probs / (torch.ones_like(probs) - probs) + eps)).sum(1)


@torch.no_grad()
def ema_update_model(model_to_update: nn.Module, model_to_merge: nn.Module, momentum: float,
                     update_all: bool = False) -> nn.Module:
  """DT ``utils/misc.py``: in place, trainable params only unless ``update_all``; returns its argument."""
  if momentum < 1.0:
    for p, q in zip(model_to_update.parameters(), model_to_merge.parameters()):
      if p.requires_grad or update_all:
        p.data = momentum * p.data + (1 - momentum) * q.data
  return model_to_update


class Reference:
  """ROID on a timm ViT: every LayerNorm's affine params, Nesterov SGD, prediction before the update."""

  def __init__(self, model: nn.Module, batch_size: int, lr: float = 2.5e-4, temperature: float = 1 / 3,
               momentum_probs: float = 0.9, momentum_src: float = 0.99, views: Optional[Iterable] = None,
               mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5)):
    self.model = model
    self.batch_size = batch_size
    self.temperature, self.momentum_probs, self.momentum_src = temperature, momentum_probs, momentum_src
    self.num_classes = model.head.out_features
    device = next(model.parameters()).device
    model.eval()
    model.requires_grad_(False)
    self.params = []
    for m in model.modules():
      if isinstance(m, nn.LayerNorm):
        m.requires_grad_(True)
        self.params += [p for n, p in m.named_parameters() if n in ("weight", "bias")]
    self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.0,
                                     nesterov=True)
    self.class_probs_ema = torch.full((self.num_classes,), 1 / self.num_classes, device=device)
    self.src_model = copy.deepcopy(model)
    for p in self.src_model.parameters():
      p.detach_()
    self.views = iter(views) if views is not None else None
    self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    self.std = torch.tensor(std, device=device).view(1, 3, 1, 1)
    self.transform = tta_transform(model.patch_embed.img_size[0])
    self.kept: list[int] = []  # samples kept by the mask, per step

  def augment(self, x: torch.Tensor, keep: torch.Tensor, view: Optional[torch.Tensor]) -> torch.Tensor:
    if view is not None:
      return view[keep.cpu()].to(x.device)
    return (self.transform(x[keep] * self.std + self.mean) - self.mean) / self.std

  def loss_calculation(self, x: torch.Tensor, view: Optional[torch.Tensor]):
    outputs = self.model(x)
    with torch.no_grad():
      weights_div = 1 - F.cosine_similarity(self.class_probs_ema.unsqueeze(0), outputs.softmax(1), dim=1)
      weights_div = (weights_div - weights_div.min()) / (weights_div.max() - weights_div.min())
      mask = weights_div < weights_div.mean()
      weights_cert = -entropy(outputs)
      weights_cert = (weights_cert - weights_cert.min()) / (weights_cert.max() - weights_cert.min())
      weights = torch.exp(weights_div * weights_cert / self.temperature)
      weights[mask] = 0.0
      self.class_probs_ema = (self.momentum_probs * self.class_probs_ema
                              + (1 - self.momentum_probs) * outputs.softmax(1).mean(0))
    self.kept.append(int((~mask).sum()))
    loss = (soft_likelihood_ratio(outputs) * weights)[~mask].sum() / self.batch_size
    outputs_aug = self.model(self.augment(x, ~mask, view))
    loss = loss + (symmetric_cross_entropy(outputs_aug, outputs[~mask]) * weights[~mask]).sum() / self.batch_size
    return outputs, loss

  def merge(self) -> None:
    ema_update_model(self.model, self.src_model, self.momentum_src)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    view = torch.as_tensor(np.array(next(self.views), np.float32)) if self.views is not None else None
    with torch.enable_grad():
      outputs, loss = self.loss_calculation(x, view)
      loss.backward()
      self.optimizer.step()
      self.optimizer.zero_grad()
    self.merge()
    with torch.no_grad():
      prior = outputs.softmax(1).mean(0)
      smooth = max(1 / outputs.shape[0], 1 / outputs.shape[1]) / torch.max(prior)
      smoothed_prior = (prior + smooth) / (1 + smooth * outputs.shape[1])
      outputs = outputs.detach() * smoothed_prior
    return outputs

  def adapted_state(self) -> dict[str, np.ndarray]:
    names = {id(p): n for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.params}
