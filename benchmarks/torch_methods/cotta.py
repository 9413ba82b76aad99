"""CoTTA in PyTorch, written as the official ``forward_and_adapt`` (``qinenergy/cotta:imagenet/cotta.py``; the
ViT runs of ``mr-eggplant/FOA``/``SPA`` use the same file with SGD lr 0.005, momentum 0.9).

Deep copies for the teacher (params detached) and the anchor, the weight/bias collector over every module,
the official order: student forward, anchor forward, plain teacher forward, the 32 augmented teacher
forwards when the anchor's mean confidence is below ``ap``, symmetric cross-entropy, SGD step, EMA teacher
update over all parameters, stochastic restore from the saved state dict.

Both random parts are injectable so a test can give both sides the same randomness:

* ``views``: an iterable with one entry per step, ``[n_aug, B, C, H, W]`` normalized views of that step's
  batch (consumed every step, used only when the step augments). Without it the reference draws its own
  views with :func:`tta_transforms` on the denormalized batch, one draw per view, as the official.
* ``masks``: an iterable with one ``{param name: bool array}`` per step, True where the restore resets the
  element. Without it, ``torch.rand(p.shape) < rst`` as the official.
"""

from __future__ import annotations

import copy
import random
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn
import torchvision.transforms as T
import torchvision.transforms.functional as TF


class ColorJitterPro(nn.Module):
  """``my_transforms.ColorJitterPro``: brightness, contrast, saturation, hue and gamma in a random order."""

  def __init__(self, brightness=(0.6, 1.4), contrast=(0.7, 1.3), saturation=(0.5, 1.5), hue=(-0.06, 0.06),
               gamma=(0.7, 1.3)):
    super().__init__()
    self.ranges = (brightness, contrast, saturation, hue, gamma)

  def forward(self, img: torch.Tensor) -> torch.Tensor:
    b, c, s, h, g = (random.uniform(*r) for r in self.ranges)
    ops = (lambda x: TF.adjust_brightness(x, b), lambda x: TF.adjust_contrast(x, c),
           lambda x: TF.adjust_saturation(x, s), lambda x: TF.adjust_hue(x, h),
           lambda x: TF.adjust_gamma(x.clamp(1e-8, 1.0), g))
    for i in torch.randperm(5).tolist():
      img = ops[i](img)
    return img


def tta_transforms(size: int, gaussian_std: float = 0.005) -> T.Compose:
  """``get_tta_transforms()`` (non-soft) for ``size`` x ``size`` images (the official hard-codes 224)."""
  clip = T.Lambda(lambda x: x.clamp(0.0, 1.0))
  return T.Compose([
      clip,
      ColorJitterPro(),
      T.Pad(padding=size // 2, padding_mode="edge"),
      T.RandomAffine(degrees=(-15, 15), translate=(1 / 16, 1 / 16), scale=(0.9, 1.1),
                     interpolation=T.InterpolationMode.BILINEAR),
      T.GaussianBlur(kernel_size=5, sigma=(0.001, 0.5)),
      T.CenterCrop(size=size),
      T.RandomHorizontalFlip(p=0.5),
      T.Lambda(lambda x: x + torch.randn_like(x) * gaussian_std),
      clip,
  ])


def symmetric_cross_entropy(x: torch.Tensor, x_ema: torch.Tensor) -> torch.Tensor:
  """The ImageNet ``softmax_entropy(x, x_ema)``: 0.5 CE(teacher -> student) + 0.5 CE(student -> teacher)."""
  return -0.5 * (x_ema.softmax(1) * x.log_softmax(1)).sum(1) - 0.5 * (x.softmax(1) * x_ema.log_softmax(1)).sum(1)


def weight_bias_params(model: nn.Module) -> dict[str, nn.Parameter]:
  """``collect_params``: every module's own parameters named ``weight``/``bias`` (not cls_token/pos_embed)."""
  return {f"{nm}.{n}" if nm else n: p for nm, m in model.named_modules()
          for n, p in m.named_parameters(recurse=False) if n in ("weight", "bias") and p.requires_grad}


class Reference:
  """CoTTA on a timm ViT; ``step`` returns the teacher's prediction made before the update."""

  def __init__(self, model: nn.Module, batch_size: int, lr: float = 0.005, momentum: float = 0.9,
               nesterov: bool = False, mt: float = 0.999, rst: float = 0.001, ap: float = 0.1, n_aug: int = 32,
               mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
               views: Optional[Iterable] = None, masks: Optional[Iterable] = None):
    # configure_model: train mode, every module trainable (only the collected ones reach the optimizer).
    self.model = model.train()
    model.requires_grad_(True)
    self.params = weight_bias_params(model)
    self.opt = torch.optim.SGD(list(self.params.values()), lr, momentum=momentum, nesterov=nesterov)
    self.model_state = copy.deepcopy(model.state_dict())
    self.anchor = copy.deepcopy(model)
    self.ema = copy.deepcopy(model)
    for p in self.ema.parameters():
      p.detach_()
    self.mt, self.rst, self.ap, self.n_aug = mt, rst, ap, n_aug
    self.mean = torch.tensor(mean).view(1, -1, 1, 1)
    self.std = torch.tensor(std).view(1, -1, 1, 1)
    self.views = iter(views) if views is not None else None
    self.masks = iter(masks) if masks is not None else None
    self.augmented: list[bool] = []  # per step, whether the teacher averaged the views
    self.anchor_conf: list[float] = []

  def transform(self, x: torch.Tensor) -> torch.Tensor:
    pixels = x * self.std.to(x) + self.mean.to(x)
    return (tta_transforms(x.shape[-1])(pixels) - self.mean.to(x)) / self.std.to(x)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    views = next(self.views) if self.views is not None else None
    masks = next(self.masks) if self.masks is not None else None
    with torch.enable_grad():
      outputs = self.model(x)
      self.ema.train()
      anchor_prob = torch.nn.functional.softmax(self.anchor(x), dim=1).max(1)[0]
      standard_ema = self.ema(x)
      to_aug = bool(anchor_prob.mean(0) < self.ap)
      self.augmented.append(to_aug)
      self.anchor_conf.append(float(anchor_prob.detach().mean(0)))
      if to_aug:
        outs = []
        for i in range(self.n_aug):
          v = self.transform(x) if views is None else torch.as_tensor(np.asarray(views[i])).to(x)
          outs.append(self.ema(v).detach())
        outputs_ema = torch.stack(outs).mean(0)
      else:
        outputs_ema = standard_ema
      loss = symmetric_cross_entropy(outputs, outputs_ema.detach()).mean(0)
      loss.backward()
      self.opt.step()
      self.opt.zero_grad()
    with torch.no_grad():
      for e, p in zip(self.ema.parameters(), self.model.parameters()):
        e.data[:] = self.mt * e[:].data[:] + (1 - self.mt) * p[:].data[:]
      for name, p in self.params.items():
        m = torch.rand(p.shape) < self.rst if masks is None else torch.as_tensor(np.asarray(masks[name]))
        m = m.float().to(p)
        p.data = self.model_state[name] * m + p * (1.0 - m)
    return outputs_ema.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    return {k: p.detach().cpu().numpy().copy() for k, p in self.params.items()}

  def teacher_state(self) -> dict[str, np.ndarray]:
    ema = dict(self.ema.named_parameters())
    return {k: ema[k].detach().cpu().numpy().copy() for k in self.params}
