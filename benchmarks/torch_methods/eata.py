"""PyTorch reference of EATA / ETA on a timm ViT, written as ``mr-eggplant/SAR:eata.py`` and ``main.py`` run it.

    ref = Reference(model, batch_size, source_batches=[x0, x1, ...])   # EATA (Fisher from the batches)
    ref = Reference(model, batch_size, fisher_alpha=0.0)               # ETA
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
  return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def update_model_probs(current: Optional[torch.Tensor], new: torch.Tensor) -> Optional[torch.Tensor]:
  """``eata.update_model_probs``: None until a batch has a sample, then 0.9 * m + 0.1 * mean(new)."""
  with torch.no_grad():
    if current is None:
      return None if new.size(0) == 0 else new.mean(0)
    return current if new.size(0) == 0 else 0.9 * current + (1 - 0.9) * new.mean(0)


def layernorm_params(model: nn.Module) -> tuple[list[nn.Parameter], list[str]]:
  """``eata.collect_params`` (SAR's version): weight and bias of every LayerNorm, the final norm included."""
  params, names = [], []
  for nm, m in model.named_modules():
    if isinstance(m, nn.LayerNorm):
      for pn, p in m.named_parameters():
        if pn in ("weight", "bias"):
          params.append(p)
          names.append(f"{nm}.{pn}")
  return params, names


def compute_fishers(model: nn.Module, batches: Sequence[torch.Tensor]) -> dict:
  """``main.py``'s Fisher loop: squared gradients of the CE against the argmax, summed, divided at the end."""
  ewc_optimizer = torch.optim.SGD(layernorm_params(model)[0], 0.001)
  fishers = {}
  loss_fn = nn.CrossEntropyLoss()
  for iter_, images in enumerate(batches, start=1):
    outputs = model(images)
    _, targets = outputs.max(1)
    loss = loss_fn(outputs, targets)
    loss.backward()
    for name, param in model.named_parameters():
      if param.grad is not None:
        fisher = param.grad.data.clone().detach() ** 2
        if iter_ > 1:
          fisher = fisher + fishers[name][0]
        if iter_ == len(batches):
          fisher = fisher / iter_
        fishers.update({name: [fisher, param.data.clone().detach()]})
    ewc_optimizer.zero_grad()
  return fishers


class Reference:
  """EATA on ``model`` (fisher_alpha > 0 and ``source_batches``) or ETA (fisher_alpha = 0)."""

  entropy = staticmethod(softmax_entropy)  # of the filter, the weight and the loss (COME's: `eata_come.py`)

  def __init__(self, model: nn.Module, batch_size: int, source_batches: Optional[Sequence[torch.Tensor]] = None,
               fisher_alpha: float = 2000.0, e_margin: Optional[float] = None, d_margin: float = 0.05,
               lr: Optional[float] = None):
    self.model = model
    num_classes = model.head.out_features
    self.e_margin = e_margin if e_margin is not None else math.log(num_classes) * 0.40
    self.d_margin = d_margin
    self.fisher_alpha = fisher_alpha
    model.requires_grad_(False)  # eata.configure_model: only the norms require grad
    self.params, self.names = layernorm_params(model)
    for p in self.params:
      p.requires_grad_(True)
    self.fishers = None
    if fisher_alpha != 0:
      if source_batches is None:
        raise ValueError("EATA with fisher_alpha > 0 needs source_batches")
      self.fishers = compute_fishers(model, list(source_batches))
    self.optimizer = torch.optim.SGD(self.params, lr if lr is not None else 0.001 / 64 * batch_size, momentum=0.9)
    self.current_model_probs: Optional[torch.Tensor] = None
    self.num_reliable = self.num_kept = 0  # of the last step

  @torch.enable_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    outputs = self.model(x)
    entropys = self.entropy(outputs)
    filter_ids_1 = torch.where(entropys < self.e_margin)
    ids2 = torch.where(filter_ids_1[0] > -0.1)
    entropys = entropys[filter_ids_1]
    if self.current_model_probs is not None:
      cos = F.cosine_similarity(self.current_model_probs.unsqueeze(dim=0), outputs[filter_ids_1].softmax(1), dim=1)
      filter_ids_2 = torch.where(torch.abs(cos) < self.d_margin)
      entropys = entropys[filter_ids_2]
      ids2 = filter_ids_2
      updated = update_model_probs(self.current_model_probs, outputs[filter_ids_1][filter_ids_2].softmax(1))
    else:
      updated = update_model_probs(self.current_model_probs, outputs[filter_ids_1].softmax(1))
    coeff = 1 / (torch.exp(entropys.clone().detach() - self.e_margin))
    loss = entropys.mul(coeff).mean(0)
    if self.fishers is not None:
      ewc_loss = 0
      for name, param in self.model.named_parameters():
        if name in self.fishers:
          ewc_loss += self.fisher_alpha * (self.fishers[name][0] * (param - self.fishers[name][1]) ** 2).sum()
      loss += ewc_loss
    if x[filter_ids_1][ids2].size(0) != 0:
      loss.backward()
      self.optimizer.step()
    self.optimizer.zero_grad()
    self.num_reliable, self.num_kept = int(filter_ids_1[0].size(0)), int(entropys.size(0))
    self.current_model_probs = updated
    return outputs.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in zip(self.names, self.params)}
