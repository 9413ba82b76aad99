"""IMSE in PyTorch, written from its official code (``baek85/IMSE`` @ b8632d6: ``method/svd.py`` class ``SVD``,
``method/decompose_svd.py`` ``SVDLinear``/``get_svd``/``convert_linear_to_svdlinear``, ``method/domain_info.py``
class ``DomainInfo``, ``method/sam.py``, ``main.py`` l. 58-123 and 245-256), as ``cfgs/vit/imse.yaml`` with
``bash/1_imse_ctta.sh``'s overrides runs it. Line numbers counted in the stored files.

* Every ``nn.Linear`` inside each block's ``Attention`` and ``Mlp`` becomes ``U diag(S) Vh`` from
  ``torch.linalg.svd(full_matrices=True)`` cut to ``r = #(S > 1e-6)`` (``get_svd`` l. 15-40), the weight rebuilt
  on each forward (l. 93-96, 107-118); ``S`` of blocks other than 9-11 is trained (``svd.py`` l. 404-418).
* Variance term (``decompose_svd.py`` l. 84-91, 120-132; ``svd.py`` l. 268-279): the Linears of the last
  ``vm_num`` blocks record the std over (batch, tokens) of ``normalize(input) @ Vh.T``; the loss is the mean of
  the stds strictly below the ``min(int(r * vm_ratio), r - 1)``-th smallest, summed, divided by ``vm_num``.
* One step (``forward_and_adapt_sar`` l. 228-266): entropy filter ``< 0.4 ln C``, loss minus ``vm_weight`` x the
  variance term, SAM's first step (global grad norm, rho 0.05), the second pass re-filtered among the first's
  samples, SAM's second step over Adam (lr 7e-3). The output is the first pass's logits.
* Detection and experts (``domain_info.py`` ``forward`` l. 54-113; ``svd.py`` ``forward`` l. 154-196,
  ``domain_shift_detected`` l. 311-320, ``setting_dynamic_mode`` l. 323-356, ``decompose_svd.py``
  ``_apply_mode_generic`` l. 175-216): as the module docstring of ``pcsr_jax/methods/imse.py`` says, written
  here as the official classes keep it (Python lists of tensors, ``None`` states, ``num_step``).
* The source entry (``svd.py`` l. 93-112): the patch-token statistics of the source images in batches of 64,
  the batches shorter than ``TEST.BATCH_SIZE`` left out (``domain_info.py`` l. 90-93). A stream batch is a
  real short batch, never padded.
* ``reset()`` here is ``main.py``'s ``reset_each_shift`` branch with ``DYNAMIC`` (l. 84-88):
  ``domain_shift_detected()`` then ``reset_soft()`` (the model and Adam from the copies taken at construction,
  ``strict=False``, so the saved experts stay).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LINEAR_OWNERS = ("Attention", "Mlp")  # convert_linear_to_svdlinear(target_replace_module=["Attention", "Mlp"])


class Factored(nn.Module):
  """One decomposed Linear (``SVDLinear`` in ``svft_variance_maximization`` mode)."""

  def __init__(self, name: str, linear: nn.Linear, record: bool):
    super().__init__()
    self.name = name
    U, S, Vh = torch.linalg.svd(linear.weight.detach().clone(), full_matrices=True)
    r = int(torch.sum(S > 1e-6))
    self.U = nn.Parameter(U[:, :r].clone(), requires_grad=False)
    self.S = nn.Parameter(S[:r].clone(), requires_grad=True)
    self.Vh = nn.Parameter(Vh[:r, :].clone(), requires_grad=False)
    self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    self.saved_S = [S[:r].clone()]  # original_S_list
    self.record = record
    self.abs_std: Optional[torch.Tensor] = None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, self.U @ torch.diag(self.S) @ self.Vh, self.bias)
    if self.record:
      projected = F.linear(x / x.norm(p=2, dim=2, keepdim=True), self.Vh)
      self.abs_std = projected.std(dim=(0, 1))
    return out

  def low_std_mean(self, ratio: float) -> torch.Tensor:
    n = self.abs_std.size(0)
    k = min(int(n * ratio), n - 1)
    ordered, _ = torch.sort(self.abs_std, dim=0)
    return self.abs_std[self.abs_std < ordered[k]].mean()


def kl_div(var_a, mean_a, var_b, mean_b) -> torch.Tensor:
  d1 = (var_a + (mean_a - mean_b) ** 2) / 2. / var_b - 0.5
  d2 = (var_b + (mean_a - mean_b) ** 2) / 2. / var_a - 0.5
  return torch.mean(d1 + d2)


class Reference:
  """IMSE on a timm ViT. ``step(x)`` returns the first pass's logits; ``source`` are the clean source images."""

  def __init__(self, model: nn.Module, batch_size: int, source: torch.Tensor, lr: float = 7e-3,
               rho: float = 0.05, vm_weight: float = 50.0, vm_num: int = 3, vm_ratio: float = 1.0,
               dss_k: float = 0.05, num_seen: int = 1, dynamic_mode: str = "top1", temp: float = 1.0,
               margin_factor: float = 0.4, skip: tuple[str, ...] = ("blocks.9", "blocks.10", "blocks.11")):
    model.requires_grad_(False)
    depth = len(model.blocks)
    vm_blocks = [f"blocks.{i}" for i in range(depth)][-vm_num:]
    self.layers: list[Factored] = []
    for outer, owner in list(model.named_modules()):
      if owner.__class__.__name__ in LINEAR_OWNERS:
        for name, child in list(owner.named_children()):
          if isinstance(child, nn.Linear):
            full = f"{outer}.{name}"
            layer = Factored(full, child, record=vm_weight > 0 and any(b in full for b in vm_blocks))
            setattr(owner, name, layer)
            self.layers.append(layer)
    self.model = model
    self.params = [l.S for l in self.layers if not any(s in l.name for s in skip)]
    self.opt = torch.optim.Adam([{"params": p, "lr": lr} for p in self.params], betas=(0.9, 0.999))
    self.rho, self.vm_weight, self.vm_num, self.vm_ratio = rho, vm_weight, vm_num, vm_ratio
    self.dss_k, self.num_seen, self.dynamic_mode, self.temp = dss_k, num_seen, dynamic_mode, temp
    self.margin = margin_factor * math.log(model.num_classes)
    self.batch_size = batch_size
    self.model_state = {k: v.clone() for k, v in model.state_dict().items()}
    self.opt_state = self.opt.state_dict()
    # DomainInfo.__init__ and SVD.__init__
    self.domain_var = self.domain_mean = None
    self.domain_infos: list[tuple[torch.Tensor, torch.Tensor]] = []
    self.num_step = 0
    self.encountered = 0
    with torch.no_grad():
      for i in range(0, len(source), 64):
        self._observe(source[i:i + 64], detect=False)
    self._save(save_s=False)
    self.encountered += 1
    self.counts = {"detected": 0, "selected": 0, "reliable": [], "experts": []}

  def patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
    m = self.model
    return m.norm_pre(m._pos_embed(m.patch_embed(x)))[:, 1:]

  def _observe(self, x: torch.Tensor, detect: bool = True) -> Optional[torch.Tensor]:
    """``DomainInfo.forward``: the shift value, a detection, the running statistics, the retrieval list."""
    z = self.patch_tokens(x)
    var, mean = z.var(dim=(0, 1)), z.mean(dim=(0, 1))
    self.last_shift = 0.0
    if detect:
      if self.domain_var is not None:
        self.last_shift = float(kl_div(self.domain_var, self.domain_mean, var, mean))
      if self.last_shift > self.dss_k:
        self.shift_detected()
        self.counts["detected"] += 1
    if z.shape[0] >= self.batch_size:
      if self.domain_var is None:
        self.domain_var, self.domain_mean = var, mean
      else:
        self.domain_var = 0.8 * self.domain_var + 0.2 * var
        self.domain_mean = 0.8 * self.domain_mean + 0.2 * mean
    values = None
    if self.num_step == 0 and len(self.domain_infos) > 1:
      values = torch.stack([kl_div(v, m, var, mean) for v, m in self.domain_infos])
    self.num_step += 1
    return values

  def _save(self, save_s: bool = True) -> None:
    if save_s:
      for l in self.layers:
        l.saved_S.append(l.S.detach().clone())
    self.domain_infos.append((self.domain_var, self.domain_mean))
    self.domain_var = self.domain_mean = None
    self.num_step = 0

  def shift_detected(self) -> None:
    self.num_step = 0
    self.encountered += 1
    self._save()

  def _load_expert(self, values: torch.Tensor) -> int:
    idx = int(values.argmin())
    w = torch.softmax(-values / self.temp, dim=0)
    for l in self.layers:
      with torch.no_grad():
        if self.dynamic_mode == "top1":
          l.S.copy_(l.saved_S[idx])
        else:
          base = l.saved_S[0]
          l.S.copy_(base + (w[:, None] * torch.stack([s - base for s in l.saved_S])).sum(0))
    self.opt.load_state_dict(self.opt_state)  # LOAD_OPTIMIZER_STATE reset
    return idx

  def _loss(self, x: torch.Tensor, keep: Optional[torch.Tensor]):
    logits = self.model(x)
    ent = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
    if keep is not None:
      ent = ent[keep]
    kept = torch.where(ent < self.margin)
    loss = ent[kept].mean(0)
    if self.vm_weight > 0:
      vm = sum(l.low_std_mean(self.vm_ratio) for l in self.layers if l.record) / self.vm_num
      loss = loss - self.vm_weight * vm
    return logits, loss, kept[0] if keep is None else keep[kept[0]]

  def step(self, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
      values = self._observe(x)
    self.selected, self.last_values = None, values
    if self.num_step == 1 and self.encountered > self.num_seen:
      self.selected = self._load_expert(values)
      self.counts["selected"] += 1
    logits, loss, kept = self._loss(x, None)
    self.opt.zero_grad()
    loss.backward()
    with torch.no_grad():  # SAM first_step
      norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in self.params]), p=2)
      old = [p.data.clone() for p in self.params]
      for p in self.params:
        p.add_(p.grad * (self.rho / (norm + 1e-12)))
    self.opt.zero_grad()
    _, loss2, kept2 = self._loss(x, kept)
    loss2.backward()
    with torch.no_grad():  # SAM second_step
      for p, o in zip(self.params, old):
        p.data = o
    self.opt.step()
    self.opt.zero_grad()
    self.counts["reliable"].append((len(kept), len(kept2)))
    self.counts["experts"].append(len(self.domain_infos))
    return logits.detach()

  def reset(self) -> None:
    """``reset_each_shift`` with ``DYNAMIC``: ``domain_shift_detected()`` then ``reset_soft()``."""
    self.shift_detected()
    self.model.load_state_dict(self.model_state, strict=False)
    self.opt.load_state_dict(self.opt_state)

  def adapted_state(self) -> dict[str, np.ndarray]:
    return {f"{l.name}.S": l.S.detach().numpy().copy() for l in self.layers}
