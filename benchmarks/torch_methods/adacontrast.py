"""AdaContrast in PyTorch, written as DT's online version (``mariodoebler/test-time-adaptation:
classification/methods/adacontrast.py``: ``AdaMoCo``, ``forward_and_adapt``, ``update_labels``,
``refine_predictions``, the losses) on a timm ViT whose feature is the pre-logit class token.

Changes: the views come from ``view_source`` when given (an iterator of ``(weak, strong_q, strong_k)``
normalised NCHW tensors, one per batch), else they are drawn with torchvision as DT's "moco-v2-light" and
"plain" transforms at res = crop = the input size; the initial queue is given (``queue``, ``queue_labels``) so a
test can start both sides from the same one (DT draws it with torch.randn/randint); the kNN bank is capped at
``queue_size`` (as `pcsr_jax.methods.adacontrast`; the same as DT whenever the batch size divides it).
"""

from __future__ import annotations

import copy
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import transforms


def features(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """timm ViT: (pre-logit class token, logits)."""
  f = model.forward_head(model.forward_features(x), pre_logits=True)
  return f, model.head(f)


class Reference:
  """``step(x)``: one DT AdaContrast step on the batch, then the student's prediction of ``x``."""

  def __init__(self, model: nn.Module, batch_size: int, lr: float = 2e-4, queue_size: int = 16384,
               ema: float = 0.999, temperature: float = 0.07, num_neighbors: int = 10, warmup: int = 1024,
               mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), queue: Optional[np.ndarray] = None,
               queue_labels: Optional[np.ndarray] = None,
               view_source: Optional[Iterator[tuple[torch.Tensor, ...]]] = None):
    self.model = model.train()
    self.momentum_model = copy.deepcopy(model).requires_grad_(False)
    self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, dampening=0, weight_decay=1e-4,
                                     nesterov=True)
    self.K, self.m, self.T = queue_size, ema, temperature
    self.num_neighbors, self.warmup = num_neighbors, warmup
    dim, classes = model.head.in_features, model.head.out_features
    if queue is None:
      queue, queue_labels = torch.randn(dim, queue_size).numpy().T, torch.randint(0, classes, (queue_size,)).numpy()
    dev = next(model.parameters()).device  # queue and banks live with the model (a GPU run keeps all there)
    self.mem_feat = F.normalize(torch.from_numpy(np.array(queue, np.float32)).T, dim=0).to(dev)  # [D, K]
    self.mem_labels = torch.from_numpy(np.array(queue_labels)).long().to(dev)
    self.queue_ptr = 0
    self.banks = {"features": torch.tensor([], device=dev), "probs": torch.tensor([], device=dev), "ptr": 0}
    self.first_x_samples = 0
    self.mean, self.std = mean, std
    self.view_source = view_source
    blur = transforms.GaussianBlur(13, sigma=(0.1, 2.0))
    self.strong = transforms.Compose([
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2), transforms.RandomApply([blur], p=0.5),
        transforms.RandomHorizontalFlip()])
    self.weak = transforms.RandomHorizontalFlip()

  def draw_views(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    mean = torch.tensor(self.mean, device=x.device)[:, None, None]
    std = torch.tensor(self.std, device=x.device)[:, None, None]
    x01 = x * std + mean
    view = lambda t: torch.stack([(t(img) - mean) / std for img in x01])
    return view(self.weak), view(self.strong), view(self.strong)

  @torch.no_grad()
  def update_memory(self, keys: torch.Tensor, labels: torch.Tensor) -> None:
    idx = torch.arange(self.queue_ptr, self.queue_ptr + len(keys), device=keys.device) % self.K
    self.mem_feat[:, idx] = keys.T
    self.mem_labels[idx] = labels
    self.queue_ptr = (self.queue_ptr + len(keys)) % self.K

  @torch.no_grad()
  def update_labels(self, feats: torch.Tensor, logits: torch.Tensor) -> None:
    probs = F.softmax(logits, dim=1)
    start = self.banks["ptr"]
    if self.banks["features"].shape[0] < self.K:
      f, p = torch.cat([self.banks["features"], feats]), torch.cat([self.banks["probs"], probs])
      over = len(f) - self.K
      if over > 0:  # capped: the overflow wraps to the front, as a ring
        f[:over], p[:over] = f[self.K:].clone(), p[self.K:].clone()
      self.banks["features"], self.banks["probs"] = f[: self.K], p[: self.K]
    else:
      idx = torch.arange(start, start + len(feats), device=feats.device) % self.K
      self.banks["features"][idx], self.banks["probs"][idx] = feats, probs
    self.banks["ptr"] = (start + len(feats)) % self.K

  @torch.no_grad()
  def pseudo_labels(self, feats_w: torch.Tensor, probs_w: torch.Tensor) -> torch.Tensor:
    if self.first_x_samples >= self.warmup:
      d = 1 - F.normalize(feats_w, dim=1) @ F.normalize(self.banks["features"], dim=1).T
      idx = d.sort(stable=True)[1][:, : self.num_neighbors]
      return self.banks["probs"][idx].mean(1).argmax(1)
    self.first_x_samples += len(feats_w)
    return probs_w.argmax(1)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    images_w, images_q, images_k = next(self.view_source) if self.view_source is not None else self.draw_views(x)
    feats_w, logits_w = features(self.model, images_w)
    labels = self.pseudo_labels(feats_w.detach(), F.softmax(logits_w.detach(), dim=1))
    feats_q, logits_q = features(self.model, images_q)
    q = F.normalize(feats_q, dim=1)
    with torch.no_grad():
      for pq, pk in zip(self.model.parameters(), self.momentum_model.parameters()):
        pk.data = pk.data * self.m + pq.data * (1.0 - self.m)
      k = F.normalize(features(self.momentum_model, images_k)[0], dim=1)
    l_neg = q @ self.mem_feat.clone().detach()
    logits_ins = torch.cat([(q * k).sum(1, keepdim=True), l_neg], dim=1) / self.T
    self.update_memory(k, labels)
    mask = torch.ones_like(logits_ins, dtype=torch.bool)
    mask[:, 1:] = labels.reshape(-1, 1) != self.mem_labels
    logits_ins = torch.where(mask, logits_ins, torch.tensor([float("-inf")], device=x.device))
    loss_ins = F.cross_entropy(logits_ins, torch.zeros(len(x), dtype=torch.long, device=x.device))
    loss_cls = F.cross_entropy(logits_q, labels)
    p_mean = F.softmax(logits_q, dim=1).mean(0)
    loss_div = torch.sum(p_mean * torch.log(p_mean + 1e-8))
    self.optimizer.zero_grad()
    (loss_cls + loss_ins + loss_div).backward()
    self.optimizer.step()
    with torch.no_grad():
      self.update_labels(*features(self.momentum_model, images_w))
      self.last_labels = labels
      return self.model(x)

  def adapted_state(self) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in self.model.named_parameters()}
