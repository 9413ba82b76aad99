"""DeYO in PyTorch, written as its official ``forward_and_adapt_deyo`` (``Jhyun17/DeYO:methods/deyo.py``):
entropy filter, patch-shuffled x' forwarded for the kept samples only, PLPD filter, reweighted entropy, and
a return before ``optimizer.step()`` when a filter keeps nothing.

The patch permutations are injectable: ``permutations`` is an iterable of ``[B, patch_len**2]`` index arrays,
one per step, giving *every* sample of the batch its permutation (row i for sample i). The reference
takes the rows of the samples that pass the entropy filter, so both sides permute each sample the same
way whichever samples pass; the JAX side draws them with `pcsr_jax.methods.deyo.DeYO.step_permutations`,
so a test feeds that sequence here. Without it, the official ``argsort(rand(n, 16))`` over the kept
samples draws them from torch's RNG.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn as nn

from benchmarks.torch_reference import sar_layernorms, softmax_entropy


def shuffle_patches(x: torch.Tensor, perm: torch.Tensor, patch_len: int) -> torch.Tensor:
  """The official 'patch' augmentation on NCHW ``x``: ``b c (ps1 h) (ps2 w) -> b (ps1 ps2) c h w``, permute,
  reassemble. (The official resizes to a multiple of ``patch_len`` and back: a no-op for the sizes used.)"""
  b, c, h, w = x.shape
  n = patch_len
  g = x.reshape(b, c, n, h // n, n, w // n).permute(0, 2, 4, 1, 3, 5).reshape(b, n * n, c, h // n, w // n)
  g = g[torch.arange(b).unsqueeze(-1), perm]
  return g.reshape(b, n, n, c, h // n, w // n).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class Reference:
  """DeYO on a timm ViT (LayerNorms of blocks 0-8, SGD with momentum, prediction before the update)."""

  def __init__(self, model: nn.Module, batch_size: int, lr: Optional[float] = None, ent_factor: float = 0.5,
               margin_factor: float = 0.4, plpd_threshold: float = 0.2, patch_len: int = 4,
               permutations: Optional[Iterable] = None):
    self.model = model
    num_classes = model.head.out_features
    self.deyo_margin = ent_factor * math.log(num_classes)
    self.margin_e0 = margin_factor * math.log(num_classes)
    self.plpd_threshold = plpd_threshold
    self.patch_len = patch_len
    self.permutations = iter(permutations) if permutations is not None else None
    lr = lr if lr is not None else 0.001 / 64 * batch_size * (2 if batch_size == 1 else 1)
    model.requires_grad_(False)
    self.params = sar_layernorms(model)
    for p in self.params:
      p.requires_grad_(True)
    self.opt = torch.optim.SGD(self.params, lr, momentum=0.9)
    self.counts: list[tuple[int, int]] = []  # (filter 1, filter 2) per step
    self.threshold_gaps: list[float] = []  # per step, the smallest |entropy - tau_Ent| and |PLPD - tau_PLPD|

  def step(self, x: torch.Tensor) -> torch.Tensor:
    perm_all = next(self.permutations) if self.permutations is not None else None
    with torch.enable_grad():
      outputs = self.model(x)
      self.opt.zero_grad()
      entropys = softmax_entropy(outputs)
      filter_ids_1 = torch.where(entropys < self.deyo_margin)
      self.threshold_gaps.append(float((entropys.detach() - self.deyo_margin).abs().min()))
      entropys = entropys[filter_ids_1]
      if len(entropys) == 0:
        self.counts.append((0, 0))
        return outputs.detach()
      x_prime = x[filter_ids_1].detach()
      n = self.patch_len
      if perm_all is None:
        perm = torch.argsort(torch.rand(x_prime.shape[0], n * n), dim=-1)
      else:
        perm = torch.as_tensor(np.array(perm_all), dtype=torch.long)[filter_ids_1[0].cpu()]
      x_prime = shuffle_patches(x_prime, perm.to(x.device), n)
      with torch.no_grad():
        outputs_prime = self.model(x_prime)
      prob = outputs[filter_ids_1].softmax(1)
      prob_prime = outputs_prime.softmax(1)
      cls1 = prob.argmax(dim=1).reshape(-1, 1)
      plpd = (torch.gather(prob, 1, cls1) - torch.gather(prob_prime, 1, cls1)).reshape(-1)
      filter_ids_2 = torch.where(plpd > self.plpd_threshold)
      self.threshold_gaps.append(float((plpd.detach() - self.plpd_threshold).abs().min()))
      entropys = entropys[filter_ids_2]
      self.counts.append((len(filter_ids_1[0]), len(entropys)))
      if len(entropys) == 0:
        return outputs.detach()
      plpd = plpd[filter_ids_2]
      coeff = 1 / torch.exp(entropys.clone().detach() - self.margin_e0) + 1 / torch.exp(-plpd.clone().detach())
      loss = entropys.mul(coeff).mean(0)
      loss.backward()
      self.opt.step()
      self.opt.zero_grad()
    return outputs.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    names = {id(p): n for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.params}
