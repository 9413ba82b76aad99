"""SPA in PyTorch, written as its official code (``mr-eggplant/SPA``: ``tta_library/spa.py``
``forward_and_adapt_eata`` with the default auxiliary loss off, ``models/byol_wrapper.py``,
``models/maskers.py`` ``LearnablePatchErasing``, the ViT-B optimizers of ``main.py``).

The views are injectable: ``views`` is an iterable of ``(masked, noise)`` per step, ``masked`` the
amplitude-masked batch ``[B, C, H, W]`` and ``noise`` the ``[C, H, W]`` Gaussian draw of the patch-noise
view (shared by the batch; patch k takes its ``[C, p, p]`` block, as the official loop draws one per
patch). The noisy view is still computed here from the learnable ``alpha``, so its gradient is the
reference's own. Without ``views`` both are drawn from torch's RNG as the official code does (the
official's hard-coded 224 x 224 masks generalised to the input size).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.torch_reference import softmax_entropy


class BYOLWrapper(nn.Module):
  """The official wrapper: an identity-initialised bias-free predictor before the head of the
  ``use_predictor`` path."""

  def __init__(self, model: nn.Module, dim: int):
    super().__init__()
    self.model = model
    self.predictor = nn.Linear(dim, dim, bias=False)
    nn.init.eye_(self.predictor.weight)

  def forward(self, x: torch.Tensor, use_predictor: bool = False) -> torch.Tensor:
    if not use_predictor:
      return self.model(x)
    features = self.model.forward_features(x)[:, 0]
    return self.model.head(self.predictor(self.model.fc_norm(features)))


def low_frequency_mask(h: int, w: int, ratio: float, device) -> torch.Tensor:
  """``Prompt.__init__``'s ``low_mask``: ones on the central ``int(side * ratio)`` block (fftshifted)."""
  ph, pw = max(int(h * ratio), 1), max(int(w * ratio), 1)
  pad_h, pad_w = (h - ph) // 2, (w - pw) // 2
  ones = torch.ones((1, 3, ph, pw), device=device)
  return F.pad(ones, [w - pad_w - pw, pad_w, h - pad_h - ph, pad_h], mode="constant", value=0.0)


def symmetric_mask(mask: torch.Tensor) -> torch.Tensor:
  """``Prompt.__convert_symmertry_mask`` (in place, as the official)."""
  sh, sw = 1 - mask.shape[-2] % 2, 1 - mask.shape[-1] % 2
  sub = mask[:, :, sh:, sw:]
  mh, mw = sub.shape[-2] // 2, sub.shape[-1] // 2
  sub[:, :, -mh:, :] = 1
  sub[:, :, mh, :mw] = 1
  sub = sub * torch.flip(sub, dims=[-1, -2])
  mask[:, :, sh:, sw:] = sub
  return mask


def amplitude_masking(x: torch.Tensor, keep_prob: float, ratio: float) -> torch.Tensor:
  """``Prompt.masking``: random keep of the low-frequency amplitudes, phase kept."""
  _, _, h, w = x.shape
  fft = torch.fft.fft2(x.clone(), dim=(-2, -1))
  amp, pha = torch.abs(fft), torch.angle(fft)
  amp = torch.fft.fftshift(amp)
  low = low_frequency_mask(h, w, ratio, x.device)
  mask = low * torch.empty_like(amp).bernoulli_(keep_prob) + (1 - low)
  amp = torch.fft.ifftshift(amp * symmetric_mask(mask))
  spec = torch.complex(real=torch.cos(pha) * amp, imag=torch.sin(pha) * amp)
  return torch.fft.ifft2(spec, dim=(-2, -1), s=[h, w]).real


class Reference:
  """SPA on a timm ViT: prediction = the original forward, before the update."""

  def __init__(self, model: nn.Module, batch_size: int, lr_norm: float = 0.01, lr_predictor: float = 0.05,
               lr_noise: float = 1.0, momentum: float = 0.9, noise_ratio: float = 0.4, noise_patch: int = 16,
               freq_mask_ratio: float = 0.2, low_freq_ratio: float = 0.2, tent_weight: float = 0.0,
               views: Optional[Iterable] = None):
    device = next(model.parameters()).device
    self.net = BYOLWrapper(model, model.head.in_features).to(device)
    self.net.requires_grad_(False)  # spa.configure_model: the predictor and every LayerNorm adapt
    self.net.predictor.requires_grad_(True)
    self.norm_params = []
    for m in self.net.modules():
      if isinstance(m, nn.LayerNorm):
        m.requires_grad_(True)
        self.norm_params += [m.weight, m.bias]
    self.optimizer = torch.optim.SGD([{"params": self.norm_params, "lr": lr_norm, "momentum": momentum},
                                      {"params": self.net.predictor.parameters(), "lr": lr_predictor,
                                       "momentum": momentum}])
    img = model.patch_embed.img_size[0]
    self.patch = noise_patch
    self.alpha = nn.Parameter(torch.ones((img // noise_patch) ** 2, device=device) * math.sqrt(noise_ratio))
    self.patch_optimizer = torch.optim.SGD([self.alpha], lr_noise, momentum=momentum)
    self.noise_ratio = noise_ratio
    self.keep_prob = 1 - freq_mask_ratio
    self.low_freq_ratio = low_freq_ratio
    self.tent_weight = tent_weight
    self.views = iter(views) if views is not None else None
    self.counts: list[tuple[int, int]] = []  # samples selected per step: (masked view, noisy view)
    self.conf_gaps: list[float] = []  # per step, the smallest |conf - conf_view| over both views

  def patch_noise(self, x: torch.Tensor, noise: Optional[torch.Tensor]) -> torch.Tensor:
    """``LearnablePatchErasing.forward``: patch k mixed with noise by alpha_k^2, then clipped to [-1, 1]."""
    c, p = x.shape[1], self.patch
    n = x.shape[-1] // p
    new = torch.empty_like(x)
    for k in range(n * n):
      i, j = (k // n) * p, (k % n) * p
      v = (torch.empty([c, p, p], dtype=torch.float32, device=x.device).normal_() if noise is None
           else noise[:, i:i + p, j:j + p])
      new[..., i:i + p, j:j + p] = (1 - self.alpha[k] ** 2) * x[..., i:i + p, j:j + p] + self.alpha[k] ** 2 * v
    return new.clip_(-1, 1)

  def consistency(self, x_view: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``get_low_consist_loss``: batch-mean KL over the samples more confident on the original."""
    low = self.net(x_view, use_predictor=True)
    conf = outputs.softmax(dim=-1).max(dim=-1)[0]
    low_conf = low.softmax(dim=-1).max(dim=-1)[0]
    ids = torch.where(conf > low_conf)
    self._count.append(len(ids[0]))
    self._gap = min(self._gap, float((conf - low_conf).detach().abs().min()))
    kl = F.kl_div(low[ids].log_softmax(dim=-1), outputs[ids].softmax(dim=-1).clone().detach(),
                  reduction="batchmean")
    return kl.mean()

  def step(self, x: torch.Tensor) -> torch.Tensor:
    masked, noise = next(self.views) if self.views is not None else (None, None)
    self._count, self._gap = [], math.inf
    with torch.enable_grad():
      outputs = self.net(x)
      if masked is None:
        masked = amplitude_masking(x, self.keep_prob, self.low_freq_ratio)
      loss = self.consistency(masked.to(x.device), outputs)
      loss = loss + self.consistency(self.patch_noise(x, None if noise is None else noise.to(x.device)), outputs)
      if self.tent_weight:
        loss = loss + self.tent_weight * softmax_entropy(outputs).mean()
      loss.backward()  # an empty selection makes its term NaN, with zero gradients (as the official)
      self.alpha.grad = -self.alpha.grad
      self.optimizer.step()
      self.optimizer.zero_grad()
      self.patch_optimizer.step()
      self.patch_optimizer.zero_grad()
    with torch.no_grad():  # fix_patch_alpha
      self.alpha /= torch.sqrt((self.alpha ** 2).mean() / self.noise_ratio)
      torch.clip_(self.alpha, -1, 1)
    self.counts.append(tuple(self._count))
    self.conf_gaps.append(self._gap)
    return outputs.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    """LayerNorms under the timm names, ``predictor.weight`` (``[out, in]``) and ``alpha``."""
    out = {n[len("model."):]: p.detach().cpu().numpy().copy() for n, p in self.net.named_parameters()
           if n.startswith("model.") and p.requires_grad}
    out["predictor.weight"] = self.net.predictor.weight.detach().cpu().numpy().copy()
    out["alpha"] = self.alpha.detach().cpu().numpy().copy()
    return out
