"""PyTorch reference of FOZO, run as ``eVI-group-SCU/FOZO`` runs it (``tta_library/FOZO.py``, ``models/vpt.py``).

A timm ViT with VPT prompts inserted after the class token (after the position embedding), the shallow/deep
halves' statistics of ``obtain_origin_stat``, the loss of ``forward_and_get_loss`` (entropy of the shifted head
plus the halves' distances), and ``forward``'s step: the in-place ``+eps Z``, ``-2 eps Z``, ``+eps Z`` moves,
the SPSA estimate, the dynamic eps/lr rule on Python floats, the ``zo_update`` with the new lr and the EMA of
the two sides' summed means. Rewritten without ``.cuda()``, the CSV log and the quantised models.

The directions Z: drawn as the official draws them (``torch.manual_seed(np.random.randint(1e9))`` then
``torch.normal``, l. 140-143, 163), unless ``directions`` (``[n_spsa, P * D]`` arrays) is set before a step, which
that step uses instead: the agreement test feeds both sides the JAX method's own draws. The reference also
records what the test compares (``losses``, ``best_index``, ``increasing``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from benchmarks.torch_methods import prompt_vit


class Reference:
  def __init__(self, model: torch.nn.Module, batch_size: int, source_batches: Sequence[torch.Tensor] = (),
               num_prompts: int = 3,
               zo_eps: float = 0.5, lr: float = 0.08, fitness_lambda: float = 0.4, n_spsa: int = 1,
               initial_prompts: Optional[np.ndarray] = None, eps_decay: float = 0.9, lr_max: float = 3.0):
    self.vit = model.eval()
    d = model.embed_dim
    self.num_prompts, self.n_spsa, self.fitness_lambda = num_prompts, n_spsa, fitness_lambda
    if initial_prompts is None:  # models/vpt.py: Xavier-uniform
      val = math.sqrt(6.0 / float(3 * math.prod(model.patch_embed.patch_size) + d))
      initial_prompts = torch.empty(1, num_prompts, d).uniform_(-val, val).numpy()
    self.initial_prompts = np.array(initial_prompts, np.float32).reshape(1, num_prompts, d)
    self.zo_eps_initial, self.lr_initial = zo_eps, lr
    # FOZO.__init__'s constants; eps_decay and lr_max given (their official 0.9 and 3.0 by default) so that a short
    # stream reaches the clips
    self.lr_min, self.lr_max, self.lr_step_size = 0.1, lr_max, 0.1
    self.loss_alpha, self.loss_increase_threshold_factor = 0.9, 1.05
    self.eps_min, self.eps_max, self.eps_decay_factor = 0.2, 0.5, eps_decay
    self.directions: Optional[np.ndarray] = None
    self.reset()
    with torch.no_grad():  # obtain_origin_stat
      per_layer = [self.layers_cls_features(x, None) for x in source_batches]
      layers = [torch.cat([f[i] for f in per_layer]) for i in range(len(per_layer[0]))]
      half = len(layers) // 2
      self.train_info = {"first_half": torch.std_mean(torch.cat(layers[:half], dim=1), dim=0),
                         "second_half": torch.std_mean(torch.cat(layers[half:], dim=1), dim=0),
                         "combined_stats": torch.std_mean(torch.cat(layers, dim=1), dim=0)}

  def reset(self) -> None:
    """FOZO.reset: h, avg, eps, lr and the prompts (the given initial ones, not a fresh draw)."""
    self.prompts = torch.tensor(self.initial_prompts, device=next(self.vit.parameters()).device)
    self.hist_stat, self.avg_loss = None, None
    self.zo_eps, self.lr = self.zo_eps_initial, self.lr_initial
    self.increasing: list[bool] = []
    self.best_index: list[int] = []

  def layers_cls_features(self, x: torch.Tensor, prompts: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """PromptViT.layers_cls_features(_with_prompts): one ``[B, D]`` tensor per layer."""
    return prompt_vit.layers_cls_features(self.vit, x, prompts)

  def _forward_and_get_loss(self, x: torch.Tensor, shift_vector: Optional[torch.Tensor]):
    feats = self.layers_cls_features(x, self.prompts)
    half = len(feats) // 2
    std1, mean1 = torch.std_mean(torch.cat(feats[:half], dim=1), dim=0)
    std2, mean2 = torch.std_mean(torch.cat(feats[half:], dim=1), dim=0)
    mse = lambda a, b: torch.nn.functional.mse_loss(a, b, reduction="none").sum()
    first, second = self.train_info["first_half"], self.train_info["second_half"]
    discrepancy = self.fitness_lambda * (mse(std1, first[0]) + mse(mean1, first[1]) + mse(std2, second[0])
                                         + mse(mean2, second[1])) * x.shape[0] / 64
    cls = feats[-1]
    if shift_vector is not None:
      cls = cls + 1.0 * shift_vector
    output = self.vit.head(cls)
    entropy = -(output.softmax(1) * output.log_softmax(1)).sum(1).sum()
    return output, discrepancy + entropy, torch.cat((mean1, mean2), dim=0)

  def _perturb(self, z: torch.Tensor, scaling_factor: float) -> None:
    self.prompts.add_(z, alpha=scaling_factor * self.zo_eps)

  @torch.no_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    """One FOZO batch (FOZO.forward): the lowest-loss candidate's (shifted) logits."""
    d = self.vit.embed_dim
    if self.directions is None:  # zo_step l. 163 and zo_perturb_parameters l. 140-143
      zs = []
      for _ in range(self.n_spsa):
        torch.manual_seed(np.random.randint(1000000000))
        zs.append(torch.normal(mean=0, std=1, size=self.prompts.shape, device=self.prompts.device))
    else:
      zs = [torch.tensor(np.asarray(z, np.float32), device=self.prompts.device).reshape(1, self.num_prompts, d)
            for z in self.directions]
      self.directions = None
    assert len(zs) == self.n_spsa
    shift = None if self.hist_stat is None else self.train_info["combined_stats"][1][-d:] - self.hist_stat[-d:]
    best_loss, best_outputs, best_index = torch.tensor(np.inf), None, -1
    means1, means2, grads, losses = [], [], [], []
    for j, z in enumerate(zs):  # zo_step
      self._perturb(z, 1)
      out1, loss1, m1 = self._forward_and_get_loss(x, shift)
      if loss1 < best_loss:
        best_loss, best_outputs, best_index = loss1, out1, 2 * j
      self._perturb(z, -2)
      out2, loss2, m2 = self._forward_and_get_loss(x, shift)
      if loss2 < best_loss:
        best_loss, best_outputs, best_index = loss2, out2, 2 * j + 1
      grads.append((loss1 - loss2) / (2 * self.zo_eps))
      self._perturb(z, 1)
      means1.append(m1)
      means2.append(m2)
      losses += [loss1.item(), loss2.item()]
    self.losses = np.asarray(losses)
    current = best_loss.item()
    self.avg_loss = current if self.avg_loss is None else (
        self.loss_alpha * self.avg_loss + (1 - self.loss_alpha) * current)
    self.zo_eps *= self.eps_decay_factor
    self.lr *= 0.7
    increasing = current > self.avg_loss * self.loss_increase_threshold_factor
    if increasing:
      self.zo_eps, self.lr = self.eps_max, self.lr_min
    else:
      self.lr = min(self.lr_max, self.lr + self.lr_step_size)
    self.zo_eps = max(self.eps_min, min(self.eps_max, self.zo_eps))
    self.lr = max(self.lr_min, min(self.lr_max, self.lr))
    for j, z in enumerate(zs):  # zo_update
      self.prompts.addcmul_(z, grads[j], value=-self.lr / self.n_spsa)
    combined = torch.stack(means1).mean(dim=0) + torch.stack(means2).mean(dim=0)
    if self.hist_stat is None:  # _update_hist
      self.hist_stat = combined.clone()
    else:
      self.hist_stat.mul_(0.9).add_(combined, alpha=0.1)
    self.increasing.append(bool(increasing))
    self.best_index.append(best_index)
    return best_outputs

  def adapted_state(self) -> dict[str, np.ndarray]:
    """FOZO changes no weight of the model; its prompts: ``prompts``."""
    return {"prompts": self.prompts.numpy().reshape(-1).copy()}
