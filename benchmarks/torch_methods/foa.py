"""PyTorch reference of FOA, run as ``mr-eggplant/FOA`` runs it (``tta_library/foa.py``, ``models/vpt.py``).

A timm ViT with VPT prompts inserted after the class token (after the position embedding), pycma's
``CMAEvolutionStrategy(dim * [0], 1, {'seed': 2020, 'popsize': 27, 'maxiter': -1, 'verbose': -1})``,
the previous best told as a 28th solution, the fitness and the activation shift of the official
``forward_and_get_loss``. The step is the official one, rewritten without ``.cuda()`` and prints; it
also records what the agreement tests compare (``candidates``, ``fitness``, ``best_index``).

pycma >= 4.1 switched the step-size control of dimensions >= 300 from CSA to two-point adaptation
(TPA); the official code ran with CSA (pycma 3.x of 2024), which is checked here.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import cma
import numpy as np
import torch

from benchmarks.torch_methods import prompt_vit


class Reference:
  def __init__(self, model: torch.nn.Module, batch_size: int, source_batches: Sequence[torch.Tensor] = (),
               num_prompts: int = 3, fitness_lambda: float = 0.4, popsize: int = 27,
               initial_prompts: Optional[np.ndarray] = None):
    self.vit = model.eval()
    self.batch_size = batch_size
    self.fitness_lambda = fitness_lambda
    self.num_prompts = num_prompts
    self.popsize_opt = popsize
    d = model.embed_dim
    if initial_prompts is None:  # VPT's Xavier-uniform init (models/vpt.py)
      val = math.sqrt(6.0 / float(3 * math.prod(model.patch_embed.patch_size) + d))
      initial_prompts = torch.empty(1, num_prompts, d).uniform_(-val, val)
    self.prompts = torch.as_tensor(np.array(initial_prompts, np.float32)).reshape(1, num_prompts, d)
    self.es = self._init_cma()
    self.best_prompts = self.prompts
    self.hist_stat = None
    with torch.no_grad():
      features = torch.cat([self.layers_cls_features(x, None) for x in source_batches])
      self.train_info = torch.std_mean(features, dim=0)

  def _init_cma(self) -> cma.CMAEvolutionStrategy:
    es = cma.CMAEvolutionStrategy(self.prompts.numel() * [0], 1, inopts={
        "seed": 2020, "popsize": self.popsize_opt, "maxiter": -1, "verbose": -1})
    if type(es.adapt_sigma).__name__ != "CMAAdaptSigmaCSA":
      raise RuntimeError(f"pycma {cma.__version__} does not use CSA here, unlike the official runs: "
                         "install cma>=3.3,<4.1")
    return es

  def layers_cls_features(self, x: torch.Tensor, prompts: Optional[torch.Tensor]) -> torch.Tensor:
    """PromptViT.layers_cls_features(_with_prompts): ``[B, depth * D]``."""
    return torch.cat(prompt_vit.layers_cls_features(self.vit, x, prompts), dim=1)

  def _forward_and_get_loss(self, x, prompts, shift_vector):
    features = self.layers_cls_features(x, prompts)
    batch_std, batch_mean = torch.std_mean(features, dim=0)
    std_mse = torch.nn.functional.mse_loss(batch_std, self.train_info[0], reduction="none")
    mean_mse = torch.nn.functional.mse_loss(batch_mean, self.train_info[1], reduction="none")
    discrepancy = self.fitness_lambda * (std_mse.sum() + mean_mse.sum()) * x.shape[0] / 64
    cls_features = features[:, -self.vit.embed_dim:]
    output = self.vit.head(cls_features)
    loss = discrepancy - (output.softmax(1) * output.log_softmax(1)).sum(1).sum()
    if shift_vector is not None:
      output = self.vit.head(cls_features + 1.0 * shift_vector)
    return output, loss, batch_mean

  @torch.no_grad()
  def step(self, x: torch.Tensor) -> torch.Tensor:
    """One FOA batch: the best candidate's (shifted) logits."""
    d = self.vit.embed_dim
    shift_vector = None if self.hist_stat is None else self.train_info[1][-d:] - self.hist_stat
    prompts = self.es.ask() + [self.best_prompts.flatten().cpu()]
    best_loss, best_outputs, losses, means = np.inf, None, [], []
    self.candidates = np.stack([np.asarray(p, np.float64) for p in prompts])
    for j, p in enumerate(prompts):
      cand = torch.tensor(np.asarray(p), dtype=torch.float, device=x.device).reshape(1, self.num_prompts, d)
      outputs, loss, batch_mean = self._forward_and_get_loss(x, cand, shift_vector)
      means.append(batch_mean[-d:].unsqueeze(0))
      if best_loss > loss.item():
        self.best_prompts, best_loss, best_outputs, self.best_index = cand, loss.item(), outputs, j
      losses.append(loss.item())
    self.fitness = np.asarray(losses)
    self.es.tell(prompts, losses)
    m = torch.cat(means).mean(0)
    self.hist_stat = m if self.hist_stat is None else 0.9 * self.hist_stat + 0.1 * m
    return best_outputs

  def adapted_state(self) -> dict[str, np.ndarray]:
    """FOA changes no weight of the model."""
    return {}
