"""A compact PyTorch reference of Source, TENT, SAR and PCSR (both recipes) on timm (the ``convert`` extra).

It follows the same protocol and hyperparameters as `pcsr_jax.methods`, written
the way the PyTorch code of the field is written (SAR's official code for
TENT/SAR, including its SAM wrapper and its reset through ``load_state_dict``;
PCSR's authors' recipe as DPAL's code runs it; the frozen recipe from the
paper's text), so that the tests can check the JAX engine against it step by
step and `step_throughput.py` can time both. ``tent-come`` and ``sar-come`` are
COME's plug-ins as ``BlueWhaleLab/COME``'s ``tent_come.py`` and ``sar_come.py``
run them: the host's step with `dirichlet_entropy` for the softmax entropy.

    ref = TorchAdapter("pcsr", timm_model, batch_size=64, pcsr_params=flax_recal_params)
    logits = ref.step(images_nchw)
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
  return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def dirichlet_entropy(x: torch.Tensor) -> torch.Tensor:
  """COME's entropy as its official code computes it (unshifted exponentials, its constant 1000 and 1e-7):
  the logits turned to their own norm with the norm detached, then the entropy of the K class entries and the
  one uncertainty entry."""
  norm = torch.norm(x, p=2, dim=-1, keepdim=True)
  x = x / norm * norm.detach()
  total = torch.exp(x).sum(dim=1, keepdim=True) + 1000
  probability = torch.cat([torch.exp(x) / total, 1000 / total], dim=1) + 1e-7
  return -(probability * torch.log(probability)).sum(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
  """x[mask].mean(), but 0 (connected to the graph) for an empty mask instead of NaN."""
  return x[mask].mean() if bool(mask.any()) else (x * 0).sum()


class Recalibrator(nn.Module):
  """PCSR's DSN + FGN of one layer (paper defaults: class+domain sum, avg pooling, shared Q/K/V factors)."""

  def __init__(self, dim: int):
    super().__init__()
    self.dsn = nn.Linear(dim, dim)
    self.fgn = nn.Linear(dim, 2 * dim)
    nn.init.zeros_(self.fgn.weight)
    nn.init.zeros_(self.fgn.bias)
    self.similarity: Optional[torch.Tensor] = None

  def forward(self, h: torch.Tensor):
    cls_tok, patches = h[:, 0], h[:, 1:]
    f = self.dsn(patches)
    fn = F.normalize(f, dim=-1, eps=1e-8)
    self.similarity = (fn @ fn.transpose(1, 2)).mean(dim=(1, 2))  # the full N x N cosine matrix (eq. 2)
    out = self.fgn(f.mean(1) + cls_tok)
    gamma, beta = out.chunk(2, dim=-1)
    return 1 + gamma, beta


class RecalibratedAttention(nn.Module):
  """timm's Attention computation with gamma * X + beta applied to Q, K and V."""

  def __init__(self, attn: nn.Module, recal: Recalibrator):
    super().__init__()
    self.attn, self.recal = attn, recal

  def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
    a = self.attn
    b, n, c = x.shape
    gamma, beta = self.recal(x)
    qkv = a.qkv(x).reshape(b, n, 3, c) * gamma[:, None, None] + beta[:, None, None]
    q, k, v = qkv.reshape(b, n, 3, a.num_heads, c // a.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v)
    return a.proj(out.transpose(1, 2).reshape(b, n, c))


class SAM(torch.optim.Optimizer):
  """Sharpness-aware minimization as SAR's and DPAL's ``sam.py`` behave.

  The wrapper's own ``state`` holds only each param's unperturbed copy; the
  update (and its momentum buffers) belongs to the inner ``base_optimizer``,
  which shares the wrapper's param groups. So ``state_dict`` /
  ``load_state_dict`` save and restore the copies, never the momentum: the
  point a faithful reset must reproduce.
  """

  def __init__(self, params, base_optimizer, rho: float = 0.05, **kwargs):
    super().__init__(params, dict(rho=rho, **kwargs))
    self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
    self.param_groups = self.base_optimizer.param_groups

  @torch.no_grad()
  def first_step(self) -> None:
    """Climb to ``w + rho * g / (||g|| + 1e-12)``, the norm over every param this optimizer holds."""
    held = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
    grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in held]), p=2)
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None:
          continue
        self.state[p]["old_p"] = p.detach().clone()
        p.add_(p.grad * (group["rho"] / (grad_norm + 1e-12)))
    self.zero_grad()

  @torch.no_grad()
  def second_step(self) -> None:
    """Back to ``w``, then the base optimizer's step with the gradient taken at ``w + e``."""
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is not None:
          p.copy_(self.state[p]["old_p"])
    self.base_optimizer.step()
    self.zero_grad()

  def load_state_dict(self, state_dict) -> None:
    super().load_state_dict(state_dict)
    self.base_optimizer.param_groups = self.param_groups


class SARStep:
  """SAR's step as the SAR-based official codes write it (VCT's ``forward_and_adapt_vct``, DCT's
  ``forward_and_adapt_dct``, each a copy of SAR's ``forward_and_adapt_sar`` with the reset of its ``forward``),
  for a reference that holds ``model``, ``opt`` (a `SAM`), ``margin``, ``reset_constant``, ``model_state`` and
  ``opt_state`` (the copies taken at construction), ``ema``, ``resets`` and ``counts``. The EMA weight is the
  codes' ``(1 - 0.9)``; the reset reloads both state dicts (SAM's keeps the inner momentum) and keeps the EMA."""

  def _sar_step(self, x: torch.Tensor) -> torch.Tensor:
    """The two passes, SAM's two steps, the EMA and the reset; returns the first forward's logits."""
    with torch.enable_grad():
      self.opt.zero_grad()
      out = self.model(x)
      ent = softmax_entropy(out)
      mask1 = ent < self.margin
      masked_mean(ent, mask1).backward()
      self.opt.first_step()  # zero_grad=True
      ent2 = softmax_entropy(self.model(x))[mask1]
      mask2 = ent2 < self.margin
      loss2 = masked_mean(ent2, mask2)
      self.counts.append((int(mask1.sum()), int(mask2.sum())))
      if bool(mask2.any()):  # a NaN loss (empty second filter) leaves the ema alone
        v = float(loss2.item())
        self.ema = v if self.ema is None else 0.9 * self.ema + (1 - 0.9) * v
      loss2.backward()
      self.opt.second_step()  # zero_grad=True
    if self.ema is not None and self.ema < self.reset_constant:
      self.model.load_state_dict(self.model_state, strict=True)
      self.opt.load_state_dict(copy.deepcopy(self.opt_state))
      self.resets += 1  # the ema is kept: the codes write it back after reset() cleared it
    return out.detach()


def sar_layernorms(model: nn.Module, skip=("blocks.9.", "blocks.10.", "blocks.11.")) -> list[nn.Parameter]:
  """SAR's adapted params: weight and bias of every LayerNorm but blocks 9-11's and the final norm."""
  return [p for nm, m in model.named_modules() if isinstance(m, nn.LayerNorm) and nm != "norm"
          and not any((nm + ".").startswith(s) for s in skip) for p in (m.weight, m.bias)]


class TorchAdapter:
  """One method on a timm ViT, stepping like `pcsr_jax.engine.Adapter` (no padding: exact batches).

  ``pcsr`` is the authors' recipe (SAR's base + PCSR's modules, DPAL's step order and reset), ``pcsr-frozen``
  the paper's text alone (backbone frozen, plain SGD, predict after the update).
  """

  def __init__(self, method: str, model: nn.Module, batch_size: int, eval_order: Optional[str] = None,
               pcsr_params: Optional[Mapping[str, Any]] = None, lr_dsn: float = 0.2, lr_fgn: float = 0.0005,
               margin: Optional[float] = None, reset_constant: float = 0.2, lr: Optional[float] = None):
    self.entropy = dirichlet_entropy if method.endswith("-come") else softmax_entropy
    method = method.removesuffix("-come")  # COME's plug-ins: the host's step with COME's entropy
    self.method = method
    self.model = model
    self.eval_order = eval_order or ("after" if method == "pcsr-frozen" else "before")
    num_classes = model.head.out_features
    self.margin = margin if margin is not None else 0.4 * math.log(num_classes)
    self.reset_constant = reset_constant
    self.ema: Optional[float] = None
    self.resets = 0
    self.rho = 0.05
    lr = lr if lr is not None else 0.001 * batch_size / 64  # the LayerNorms' (SAR's code: 0.001 * B / 64)
    model.requires_grad_(False)
    if method == "source":
      self.params = []
    elif method == "tent":
      self.params = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)]
      self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)
    elif method == "sar":
      self.params = sar_layernorms(model)
      self.opt = SAM(self.params, torch.optim.SGD, rho=self.rho, lr=lr * (2 if batch_size == 1 else 1),
                     momentum=0.9)
    elif method in ("pcsr", "pcsr-frozen"):
      d = model.embed_dim
      self.recals = nn.ModuleList([Recalibrator(d) for _ in model.blocks]).to(model.cls_token.device)
      for i, (blk, rc) in enumerate(zip(model.blocks, self.recals)):
        if pcsr_params is not None:
          load_recalibrator(rc, pcsr_params[f"recal_{i}"])
        blk.attn = RecalibratedAttention(blk.attn, rc)
      dsn = [p for rc in self.recals for p in rc.dsn.parameters()]
      fgn = [p for rc in self.recals for p in rc.fgn.parameters()]
      if method == "pcsr-frozen":
        self.opt = torch.optim.SGD([{"params": dsn, "lr": lr_dsn}, {"params": fgn, "lr": lr_fgn}], lr=lr_fgn,
                                   momentum=0.9)
        self.params = list(self.recals.parameters())
      else:  # DPAL: LayerNorms and FGN in SAM, the DSN in its own plain SGD
        self.norms = sar_layernorms(model)
        self.opt = SAM([{"params": self.norms, "lr": lr}, {"params": fgn, "lr": lr_fgn}], torch.optim.SGD,
                       rho=self.rho, lr=lr, momentum=0.9)
        self.dsn_opt = torch.optim.SGD(dsn, lr=lr_dsn, momentum=0.9)
        self.params = self.norms + list(self.recals.parameters())
    else:
      raise ValueError(f"unknown method {method!r}")
    for p in self.params:
      p.requires_grad_(True)
    # What SAR's / DPAL's reset reloads: the model's and every optimizer's state_dict at construction.
    self.model_state = copy.deepcopy(model.state_dict())
    self.opt_states = [copy.deepcopy(o.state_dict()) for o in self._optimizers()]

  def _optimizers(self) -> list[torch.optim.Optimizer]:
    return [o for o in (getattr(self, "opt", None), getattr(self, "dsn_opt", None)) if o is not None]

  def step(self, x: torch.Tensor) -> torch.Tensor:
    if self.method == "source":
      with torch.no_grad():
        return self.model(x)
    logits = getattr(self, f"_step_{self.method.replace('-', '_')}")(x)
    if self.eval_order == "after":
      with torch.no_grad():
        logits = self.model(x)
    elif self.eval_order == "perturbed":
      logits = self.perturbed_logits
    return logits.detach()

  def _step_tent(self, x):
    out = self.model(x)
    loss = self.entropy(out).mean(0)
    self.opt.zero_grad()
    loss.backward()
    self.opt.step()
    return out

  def _second_pass_and_recovery(self, x, mask1) -> None:
    """SAR's second forward at the perturbed weights, SAM's second step, the EMA and the reset."""
    out2 = self.model(x)
    self.perturbed_logits = out2
    ent2 = self.entropy(out2)[mask1]
    mask2 = ent2 < self.margin
    loss2 = masked_mean(ent2, mask2)
    if bool(mask2.any()):  # the official code skips a NaN loss (empty second mask)
      v = float(loss2.item())
      self.ema = v if self.ema is None else 0.9 * self.ema + 0.1 * v
    loss2.backward()
    self.opt.second_step()
    if self.ema is not None and self.ema < self.reset_constant:
      self.model.load_state_dict(self.model_state, strict=True)
      for o, st in zip(self._optimizers(), self.opt_states):
        o.load_state_dict(copy.deepcopy(st))
      self.resets += 1  # the caller writes the pre-reset EMA back: self.ema is kept

  def _step_sar(self, x):
    self.opt.zero_grad()
    out = self.model(x)
    ent = self.entropy(out)
    mask1 = ent < self.margin
    masked_mean(ent, mask1).backward()
    self.opt.first_step()
    self._second_pass_and_recovery(x, mask1)
    return out

  def _pcsr_loss(self, out):
    ent = softmax_entropy(out)
    mask = ent < self.margin
    l_sim = -torch.stack([rc.similarity for rc in self.recals]).mean(0).mean()
    return masked_mean(ent, mask) + (mask.sum() / out.shape[0]) * l_sim, mask

  def _step_pcsr(self, x):
    self.opt.zero_grad()
    self.dsn_opt.zero_grad()
    out = self.model(x)
    loss, mask1 = self._pcsr_loss(out)
    loss.backward()
    self.dsn_opt.step()  # DPAL's order: the plain SGD first, then SAM's two steps
    self.opt.first_step()
    self._second_pass_and_recovery(x, mask1)
    return out

  def _step_pcsr_frozen(self, x):
    out = self.model(x)
    loss, _ = self._pcsr_loss(out)
    self.opt.zero_grad()
    loss.backward()
    self.opt.step()
    return out

  def adapted_state(self) -> dict[str, np.ndarray]:
    """The adapted params as numpy: timm names (LayerNorms) and ``recal_i.{dsn,fgn}.{weight,bias}``."""
    names = {id(p): n for n, p in self.model.named_parameters()}
    out = {}
    if self.method.startswith("pcsr"):
      out = {f"recal_{i}.{k}": v.detach().cpu().numpy().copy() for i, rc in enumerate(self.recals)
             for k, v in rc.state_dict().items() if not k.startswith("similarity")}
    for p in getattr(self, "norms", []) if self.method.startswith("pcsr") else self.params:
      out[names[id(p)]] = p.detach().cpu().numpy().copy()
    return out


def load_recalibrator(rc: Recalibrator, p: Mapping[str, Any]) -> None:
  """Loads Flax recalibrator params (``{'dsn': {'kernel', 'bias'}, 'fgn': ...}``) into a torch Recalibrator."""
  with torch.no_grad():
    for name in ("dsn", "fgn"):
      lin = getattr(rc, name)
      lin.weight.copy_(torch.from_numpy(np.asarray(p[name]["kernel"]).T.copy()))
      lin.bias.copy_(torch.from_numpy(np.asarray(p[name]["bias"]).copy()))


ORIGINAL = ("source", "tent", "sar", "pcsr", "pcsr-frozen", "tent-come", "sar-come")  # `TorchAdapter`'s methods


def make_reference(method: str, model: nn.Module, batch_size: int, **kw):
  """The PyTorch reference of ``method``: `TorchAdapter` for the original methods, else the ``Reference``
  class of ``benchmarks/torch_methods/<method>.py`` (dashes as underscores)."""
  if method in ORIGINAL:
    return TorchAdapter(method, model, batch_size, **kw)
  import importlib

  module = importlib.import_module(f"benchmarks.torch_methods.{method.replace('-', '_')}")
  return module.Reference(model, batch_size, **kw)
