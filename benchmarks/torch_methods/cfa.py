"""PyTorch reference of CFA on a timm ViT, written as ``kojima-takeshi188/CFA`` runs it (``utils_adapt.py``,
``utils_statistics.py``, ``utils.py``, ``utils_model.py``; defaults from ``main.py``).

    ref = Reference(model, batch_size, source_batches=[(x0, y0), (x1, y1), ...])

The statistics are computed from ``source_batches`` as ``calc_cmd_statistics`` does (two passes, float32
sums). A class without source images gets a NaN mean there, as in the official code.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def h_std(h: torch.Tensor) -> torch.Tensor:
  return nn.Tanh()(nn.LayerNorm(h.shape[-1], eps=1e-05, elementwise_affine=False)(h))


class ModelWrapper(nn.Module):
  """``utils_model.Model_Wrapper``: ``(logits, head input)`` through a forward pre-hook on the head."""

  def __init__(self, model: nn.Module):
    super().__init__()
    self.model = model
    self.model.head.register_forward_pre_hook(self._hook)
    self._h = None

  def _hook(self, module, inputs):
    self._h = inputs[0]

  def forward(self, x):
    logits = self.model(x)
    return logits, self._h


def calc_cmd_statistics(model: nn.Module, batches, save_max_moment: int = 5) -> dict:
  """``utils_statistics.calc_cmd_statistics``: overall and per-class mean, then central moments 2..5."""
  model.eval()
  with torch.no_grad():
    total, total_cls = 0, 0
    mid_ent_cms, mid_cls_cms = [0] * save_max_moment, [0] * save_max_moment
    for x, y in batches:
      logits, h = model(x)
      h = h_std(h)
      total += y.size(0)
      mid_ent_cms[0] += torch.sum(h, dim=0, keepdim=True)
      y_onehot = torch.unsqueeze(F.one_hot(y, num_classes=logits.shape[-1]), dim=-1)
      mid_cls_cms[0] += torch.sum(y_onehot * torch.unsqueeze(h, dim=1), dim=0, keepdim=True)
      total_cls += torch.sum(y_onehot, dim=0, keepdim=True)
    mid_ent_cms[0] = copy.deepcopy(mid_ent_cms[0] / total)
    mid_cls_cms[0] = copy.deepcopy(mid_cls_cms[0] / total_cls)
    total, total_cls = 0, 0
    for x, y in batches:
      logits, h = model(x)
      h = h_std(h)
      total += y.size(0)
      y_onehot = torch.unsqueeze(F.one_hot(y, num_classes=logits.shape[-1]), dim=-1)
      h_ext = torch.unsqueeze(h, dim=1)
      total_cls += torch.sum(y_onehot, dim=0, keepdim=True)
      for j in range(1, save_max_moment):
        mid_ent_cms[j] += torch.sum(torch.pow(h - mid_ent_cms[0], j + 1), dim=0, keepdim=True)
        mid_cls_cms[j] += torch.sum(torch.pow(y_onehot * h_ext - y_onehot * mid_cls_cms[0], j + 1), dim=0,
                                    keepdim=True)
    for j in range(1, save_max_moment):
      mid_ent_cms[j] = mid_ent_cms[j] / total
      mid_cls_cms[j] = mid_cls_cms[j] / total_cls
  return {"cmd_base_mid": mid_ent_cms, "cmd_base_mid_cls": mid_cls_cms}


def cmd_optimization(h, statistics, full_max_moment, value_min=-1.0, value_max=1.0):
  loss = 0
  moments = [0] * full_max_moment
  for j in range(full_max_moment):
    if j == 0:
      moments[j] = torch.mean(h, dim=0, keepdim=True)
    else:
      moments[j] = torch.mean(torch.pow(h - moments[0], j + 1), dim=0, keepdim=True)
    loss += torch.sqrt(torch.sum(torch.square(moments[j] - statistics[j]))) / ((value_max - value_min) ** (j + 1))
  return loss


def cmd_optimization_for_cls(logits, h, statistics, cls_max_moment=1, value_min=-1.0, value_max=1.0):
  h = torch.unsqueeze(h, dim=1)
  argmax_class = F.one_hot(torch.argmax(logits, dim=1), num_classes=logits.shape[-1]).clone().detach()
  argmax_class = torch.unsqueeze(argmax_class, dim=-1)
  argmax_class_num = torch.clamp(torch.sum(argmax_class, dim=0), min=1)
  argmax_class_idx = torch.clamp(torch.sum(argmax_class, dim=0), min=0, max=1)
  loss = 0
  moments = [0] * cls_max_moment
  for j in range(cls_max_moment):
    if j == 0:
      moments[j] = torch.sum(argmax_class * h, dim=0, keepdim=True) / argmax_class_num
    else:
      moments[j] = torch.sum(torch.pow(argmax_class * h - argmax_class * moments[0], j + 1), dim=0,
                             keepdim=True) / argmax_class_num
    loss_cls = torch.sqrt(torch.sum(torch.square(moments[j] - statistics[j]), dim=-1, keepdim=True))
    loss_cls = loss_cls / ((value_max - value_min) ** (j + 1))
    loss += torch.sum(loss_cls * argmax_class_idx) / torch.sum(argmax_class_idx)
  return loss


class Reference:
  """CFA ('partial' params, SGD momentum 0.9, clip_grad_norm_) on a timm ViT."""

  def __init__(self, model: nn.Module, batch_size: int, source_batches: Sequence = (), lr: float = 0.001,
               max_grad_norm: Optional[float] = 1.0, full_max_moment: int = 3, lambda1: float = 1.0,
               lambda2: float = 1.0):
    self.model = ModelWrapper(model)
    self.statistics = calc_cmd_statistics(self.model, [(x, torch.as_tensor(y)) for x, y in source_batches])
    self.max_grad_norm, self.full_max_moment = max_grad_norm, full_max_moment
    self.lambda1, self.lambda2 = lambda1, lambda2
    self.names, params = [], []
    for name, param in self.model.named_parameters():  # collect_params, 'partial'
      if "norm" in name:
        params.append({"params": param})
        self.names.append(name)
        param.requires_grad = True
      else:
        param.requires_grad = False
    self.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.0)
    self.model.eval()
    self.grad_norm = None  # the total gradient norm before clipping, of the last step

  @torch.enable_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    self.model.zero_grad()
    logits, h = self.model(x)
    h = h_std(h)
    loss1 = cmd_optimization(h, self.statistics["cmd_base_mid"], self.full_max_moment)
    loss2 = cmd_optimization_for_cls(logits, h, self.statistics["cmd_base_mid_cls"])
    loss = self.lambda1 * loss1 + self.lambda2 * loss2
    loss.backward()
    if self.max_grad_norm is not None:
      self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
    self.optimizer.step()
    self.model.zero_grad()
    return logits.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    return {n[len("model."):]: p.detach().cpu().numpy().copy() for n, p in self.model.named_parameters()
            if n in self.names}
