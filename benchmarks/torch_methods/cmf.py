"""CMF in PyTorch, written as DT's ``classification/methods/cmf.py`` runs it: ROID's loss (the ROID
reference) and, after each step, ``bayesian_filtering`` over full copies of the model (source, hidden)
with the variance and gain as Python floats. Views are injectable as in `benchmarks.torch_methods.roid`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from benchmarks.torch_methods.roid import Reference as ROIDReference
from benchmarks.torch_methods.roid import ema_update_model


class Reference(ROIDReference):
  """CMF on a timm ViT (DT's defaults: alpha = gamma = 0.99, Q = 0.005, TYPE "lp")."""

  def __init__(self, model: nn.Module, batch_size: int, alpha: float = 0.99, gamma: float = 0.99,
               q: float = 0.005, **kw):
    super().__init__(model, batch_size, **kw)
    num_trainable = sum(p.numel() for p in self.params)
    self.alpha, self.gamma = alpha, gamma
    self.q = q * num_trainable / 38400
    self.hidden_model = copy.deepcopy(self.model)
    for p in self.hidden_model.parameters():
      p.detach_()
    self.hidden_var = 0
    self.betas: list[float] = []

  @torch.no_grad()
  def merge(self) -> None:
    recovered = ema_update_model(self.hidden_model, self.src_model, self.alpha, update_all=True)
    self.hidden_var = self.alpha**2 * self.hidden_var + self.q
    r = 1 - self.q
    beta = r / (self.hidden_var + r)
    beta = beta if beta > 0.89 else 0.89
    beta = beta if beta < 0.9999 else 1.0
    self.betas.append(beta)
    self.hidden_var = beta * self.hidden_var
    self.hidden_model = ema_update_model(recovered, self.model, beta, update_all=True)
    self.model = ema_update_model(self.model, self.hidden_model, self.gamma)
