"""ZeroSiam in PyTorch, written from its official code (``Cascol-Chen/ZeroSiam`` @ 57dfceb:
``tta_library/zerosiam.py`` class ``ZeroSiam`` (``forward_and_adapt`` l. 46-63, ``cal_loss`` l. 65-77,
``symmetric_kl_divergence`` l. 95-103, ``collect_params`` l. 106-116, ``configure_model`` l. 134-156),
``models/byol_wrapper.py`` (predictor l. 32-36, forward l. 38-54, ``head`` l. 65-67) and the ``zerosiam``
branch of ``main.py`` ``get_adapted_model`` (l. 106-115) with the learning rates of ``build_model``, the
``double_lr_settings`` block of ``__main__``, ``main.sh`` and the README). Line numbers are counted in the
stored text of those files. The earlier commit 2dd3fc4 (class ``Tent``, ``get_loss_js``, ``plain_entropy``)
computes the same update.

One step, as the official code runs it on a timm ViT (class token):

* a single backbone pass ``z = forward_features(x)`` (all tokens after the final ``norm``); the returned
  prediction is ``forward_head(z)``, the logits *before* the update (``byol_wrapper.py`` l. 47-49,
  ``zerosiam.py`` l. 54, 63); the feature is the CLS token ``f = z[:, 0]`` (``byol_wrapper.py`` l. 53-54);
* target ``t = head(f).detach()`` (``zerosiam.py`` l. 68); online ``o = head(P f)`` with ``P`` a bias-free
  ``Linear(D, D)`` initialised to the identity (``byol_wrapper.py`` l. 33-35; ``zerosiam.py`` l. 79-81);
  ``head`` is the frozen classifier, ``fc_norm``/``head_drop`` are skipped (identities for a token-pooled ViT);
* ``loss = mean_b H(softmax o_b) + alpha * mean_b [KL(p_t || p_o) + KL(p_o || p_t)]`` with ``alpha = 1``
  (``alignment_weight``, ``zerosiam.py`` l. 25, 34, 74-77). Each KL is ``F.kl_div(..., reduction='none')
  .sum(1)`` per sample, then ``.mean(0)`` over the batch (l. 101-103, 75): i.e. a batch mean of per-sample
  sums. Only ``t`` is detached: the gradient flows through ``o`` in both KL directions, including the one
  where ``softmax(o)`` is the ``kl_div`` *target* (l. 102). It reaches the LayerNorms through ``f`` along the
  online branch only;
* ``loss.backward()``, then ``backbone_optimizer.step()``, ``predictor_optimizer.step()``, then both
  ``zero_grad()`` (l. 57-61). Both are ``SGD(momentum=0.9)``, no weight decay / nesterov (``main.py``
  l. 111-112). The backbone optimizer holds the weight and bias of *every* ``LayerNorm`` of the wrapped
  model (``collect_params``: all ``blocks.i.norm1/norm2`` and the final ``norm``); the predictor optimizer
  holds ``predictor[0].weight``. The classifier head and everything else are frozen (``configure_model``).

No filtering, no EMA, no reset: ``episodic=False`` and ``steps=1`` by default (l. 25, 38-44), and ``main.py``
builds a fresh model (and predictor) per corruption. ``configure_model`` calls ``model.train()`` but
``validate`` then calls ``model.eval()`` on the wrapper, so the network runs in eval mode (irrelevant for a
ViT without dropout); this reference leaves the model's mode as given.

Learning rates (ViT-B, ``--model vitbase_timm``): ``build_model`` sets ``args.lr = (0.001 / 64) * bs``; the
LayerNorm lr is ``args.lr * lr_scale`` and the predictor lr ``args.lr * lr_p`` (``main.py`` l. 111-112).
``get_args`` defaults both factors to 1, but ``main.sh`` and the README set ``lr_scale = lr_p = 5`` for
ViT-B, so both are 0.005 at ``B = 64`` (the defaults here). ``args.lr`` is doubled (before the factors)
when ``exp_type`` is ``bs1`` or ``label_shifts+bs1`` (``double_lr_settings``), the settings that force
``B = 1``; this reference doubles at ``batch_size == 1``. (The blind-spot setting ``incorrect_labels_k*``
also adapts at ``B = 1`` but is not doubled.) The other exp types (normal, label_shifts, mix_shifts) only
change the data stream, not the algorithm.

Not carried over: ``main.py`` @ 57dfceb ``validate`` has an unconditional ``break`` after the first batch
(evaluation-only artifact, absent in 2dd3fc4). The official names the predictor ``predictor.0.weight``
(an ``nn.Sequential``); ``adapted_state`` reports it as ``predictor.weight`` (torch layout ``[out, in]``).
Official environment: timm 0.6.12, torch 1.8 (``environment.yml``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.torch_reference import softmax_entropy


def symmetric_kl(online: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
  """Per-sample ``KL(p_t || p_o) + KL(p_o || p_t)`` as ``zerosiam.py`` l. 101-103 (the 2dd3fc4 code calls it
  ``get_loss_js``): ``kl_div`` sums over classes, no batch reduction here."""
  t_to_o = F.kl_div(online.log_softmax(dim=1), target.softmax(dim=1), reduction="none").sum(1)
  o_to_t = F.kl_div(target.log_softmax(dim=1), online.softmax(dim=1), reduction="none").sum(1)
  return t_to_o + o_to_t


class Reference:
  """ZeroSiam on a timm ViT: every LayerNorm + an identity-initialised predictor, two momentum SGDs,
  prediction = the logits of the single forward, before the update."""

  def __init__(self, model: nn.Module, batch_size: int, lr: float | None = None,
               lr_predictor: float | None = None, kl_weight: float = 1.0, momentum: float = 0.9):
    self.model = model
    param = next(model.parameters())
    dim = model.head.weight.shape[1]  # byol_wrapper.py l. 26-27: the head's input dimension
    self.predictor = nn.Linear(dim, dim, bias=False).to(device=param.device, dtype=param.dtype)
    nn.init.eye_(self.predictor.weight)
    base = 0.001 / 64 * batch_size * (2 if batch_size == 1 else 1)  # build_model + double_lr_settings
    self.lr = lr if lr is not None else base * 5  # lr_scale = 5 (ViT-B, main.sh / README)
    self.lr_predictor = lr_predictor if lr_predictor is not None else base * 5  # lr_p = 5
    self.kl_weight = kl_weight
    model.requires_grad_(False)  # configure_model: only the norms and the predictor adapt
    self.norm_names: list[str] = []
    self.norm_params: list[nn.Parameter] = []
    for module_name, module in model.named_modules():  # collect_params: every LayerNorm, final norm included
      if isinstance(module, nn.LayerNorm):
        for param_name, p in module.named_parameters():
          if param_name in ("weight", "bias"):
            p.requires_grad_(True)
            self.norm_names.append(f"{module_name}.{param_name}")
            self.norm_params.append(p)
    self.predictor.requires_grad_(True)
    self.backbone_optimizer = torch.optim.SGD(self.norm_params, self.lr, momentum=momentum)
    self.predictor_optimizer = torch.optim.SGD(self.predictor.parameters(), self.lr_predictor, momentum=momentum)
    self.losses: list[float] = []

  def step(self, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
      tokens = self.model.forward_features(x)  # one backbone pass, final norm applied
      outputs = self.model.forward_head(tokens)  # the reported prediction
      features = tokens[:, 0]  # CLS token
      target = self.model.head(features).detach()
      online = self.model.head(self.predictor(features))
      loss = softmax_entropy(online).mean(0) + self.kl_weight * symmetric_kl(online, target).mean(0)
      loss.backward()
      self.backbone_optimizer.step()
      self.predictor_optimizer.step()
      self.backbone_optimizer.zero_grad()
      self.predictor_optimizer.zero_grad()
    self.losses.append(float(loss.detach()))
    return outputs.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    """Every LayerNorm under its timm name and ``predictor.weight`` (``[out, in]``)."""
    out = {n: p.detach().cpu().numpy().copy() for n, p in zip(self.norm_names, self.norm_params)}
    out["predictor.weight"] = self.predictor.weight.detach().cpu().numpy().copy()
    return out
