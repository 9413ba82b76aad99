"""MEMO in PyTorch, written as its official code (``zhangmarvin/memo:imagenet-exps/test_calls/test_adapt.py``,
``utils/adapt_helpers.py``, AugMix of ``utils/third_party.py``) with the ViT-family AdamW setting.

Per image: reload the source weights, one AdamW step on the marginal entropy of ``views`` augmented views,
then predict the clean image. Two changes: the AdamW state is fresh for every image (DT's ``reset()``; the
official script keeps one optimizer whose moments carry over, see `pcsr_jax.methods.memo`), and the views come
from ``view_source`` when given (an iterator of ``[V, C, H, W]`` normalised tensors, one per image), so a test
can feed the JAX method the same views.
"""

from __future__ import annotations

import copy
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn as nn
from PIL import Image, ImageOps
from torchvision import transforms


def marginal_entropy(outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
  avg_logits = logits.logsumexp(dim=0) - np.log(logits.shape[0])
  avg_logits = torch.clamp(avg_logits, min=torch.finfo(avg_logits.dtype).min)
  return -(avg_logits * torch.exp(avg_logits)).sum(dim=-1), avg_logits


def _level() -> tuple[float, float]:
  u = np.random.uniform(low=0.1, high=1.0)
  return u, (-1.0 if np.random.uniform() > 0.5 else 1.0)


def _affine(img: Image.Image, coeffs: tuple) -> Image.Image:
  return img.transform(img.size, Image.AFFINE, coeffs, resample=Image.BILINEAR)


def _ops(size: int):
  """The nine AugMix ops at severity 1 (magnitudes as ``third_party.py``)."""

  def rotate(img):
    u, s = _level()
    return img.rotate(s * int(u * 3), resample=Image.BILINEAR)

  def solarize(img):
    u, _ = _level()
    return ImageOps.solarize(img, 256 - int(u * 256 / 10))

  def shear(axis):
    def op(img):
      u, s = _level()
      return _affine(img, (1, s * u * 0.03, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, s * u * 0.03, 1, 0))
    return op

  def translate(axis):
    def op(img):
      u, s = _level()
      t = s * int(u * size / 3 / 10)
      return _affine(img, (1, 0, t, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, t))
    return op

  def posterize(img):
    u, _ = _level()
    return ImageOps.posterize(img, 4 - int(u * 4 / 10))

  return [ImageOps.autocontrast, ImageOps.equalize, rotate, solarize, shear(0), shear(1), translate(0),
          translate(1), posterize]


def augmix_view(img: Image.Image, size: int, mean, std) -> torch.Tensor:
  """RandomResizedCrop + flip + AugMix (3 chains of 1-3 ops, Dirichlet(1) weights, Beta(1, 1) mix)."""
  crop = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()])(img)
  pre = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
  ops = _ops(224)  # MEMO's magnitudes use a hard-coded 224
  w = np.float32(np.random.dirichlet([1.0] * 3))
  m = np.float32(np.random.beta(1.0, 1.0))
  mix = torch.zeros_like(pre(crop))
  for i in range(3):
    x = crop.copy()
    for _ in range(np.random.randint(1, 4)):
      x = np.random.choice(ops)(x)
    mix += w[i] * pre(x)
  return m * pre(crop) + (1 - m) * mix


class Reference:
  """MEMO on a timm model: ``step(x)`` adapts a copy of the source model per image and predicts it."""

  def __init__(self, model: nn.Module, batch_size: int, views: int = 64, lr: float = 1e-5,
               weight_decay: float = 0.01, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
               view_source: Optional[Iterator[torch.Tensor]] = None):
    self.model = model.eval()
    self.source = copy.deepcopy(model.state_dict())
    self.views, self.lr, self.weight_decay = views, lr, weight_decay
    self.mean, self.std = mean, std
    self.view_source = view_source
    self.last_adapted = None

  def draw_views(self, x: torch.Tensor) -> torch.Tensor:
    # AugMix works on PIL images on the host, as the official code's does; the views go back to x's device.
    mean, std = torch.tensor(self.mean)[:, None, None], torch.tensor(self.std)[:, None, None]
    img = transforms.ToPILImage()((x.detach().cpu() * std + mean).clamp(0, 1))
    return torch.stack([augmix_view(img, x.shape[-1], self.mean, self.std) for _ in range(self.views)]).to(x.device)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    out = []
    for image in x:
      self.model.load_state_dict(self.source)
      optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)
      views = next(self.view_source) if self.view_source is not None else self.draw_views(image)
      optimizer.zero_grad()
      loss, _ = marginal_entropy(self.model(views))
      loss.backward()
      optimizer.step()
      with torch.no_grad():
        out.append(self.model(image[None])[0])
    # Kept on the device, once per step: a host copy of every param (346 MB at ViT-B) per image is not MEMO's
    # work, and an H200 run timed it (`adapted_state` copies to the host when asked).
    self.last_adapted = {k: v.detach().clone() for k, v in self.model.named_parameters()}
    self.model.load_state_dict(self.source)
    return torch.stack(out)

  def adapted_state(self) -> dict[str, np.ndarray]:
    """The params adapted for the last image of the last step (every image has its own)."""
    return {k: v.cpu().numpy() for k, v in self.last_adapted.items()}
