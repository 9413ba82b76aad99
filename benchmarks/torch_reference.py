"""A compact PyTorch reference of Source, TENT, SAR and PCSR on timm (the ``convert`` extra).

It follows the same protocol and hyperparameters as `pcsr_jax.methods`, written
the way the PyTorch code of the field is written (SAR's official code for
TENT/SAR; PCSR from the paper), so that the tests can check the JAX engine
against it step by step and `step_throughput.py` can time both.

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


class TorchAdapter:
  """One method on a timm ViT, stepping like `pcsr_jax.engine.Adapter` (no padding: exact batches)."""

  def __init__(self, method: str, model: nn.Module, batch_size: int, eval_order: Optional[str] = None,
               pcsr_params: Optional[Mapping[str, Any]] = None, lr_dsn: float = 0.2, lr_fgn: float = 0.0005,
               margin: Optional[float] = None):
    self.method = method
    self.model = model
    self.eval_order = eval_order or ("after" if method == "pcsr" else "before")
    num_classes = model.head.out_features
    self.margin = margin if margin is not None else 0.4 * math.log(num_classes)
    lr = 0.001 * batch_size / 64
    model.requires_grad_(False)
    if method == "source":
      self.params = []
    elif method == "tent":
      self.params = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)]
      self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)
    elif method == "sar":
      skip = ("blocks.9.", "blocks.10.", "blocks.11.")
      self.params = [p for nm, m in model.named_modules() if isinstance(m, nn.LayerNorm) and nm != "norm"
                     and not any((nm + ".").startswith(s) for s in skip) for p in (m.weight, m.bias)]
      self.opt = torch.optim.SGD(self.params, lr=lr * (2 if batch_size == 1 else 1), momentum=0.9)
      self.ema: Optional[float] = None
      self.rho = 0.05
      self.source = (copy.deepcopy([p.detach().clone() for p in self.params]), copy.deepcopy(self.opt.state_dict()))
    elif method == "pcsr":
      d = model.embed_dim
      self.recals = nn.ModuleList([Recalibrator(d) for _ in model.blocks]).to(model.cls_token.device)
      for i, (blk, rc) in enumerate(zip(model.blocks, self.recals)):
        if pcsr_params is not None:
          load_recalibrator(rc, pcsr_params[f"recal_{i}"])
        blk.attn = RecalibratedAttention(blk.attn, rc)
      self.opt = torch.optim.SGD([
          {"params": [p for rc in self.recals for p in rc.dsn.parameters()], "lr": lr_dsn},
          {"params": [p for rc in self.recals for p in rc.fgn.parameters()], "lr": lr_fgn}], lr=lr_fgn,
          momentum=0.9)
      self.params = list(self.recals.parameters())
    else:
      raise ValueError(f"unknown method {method!r}")
    for p in self.params:
      p.requires_grad_(True)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    if self.method == "source":
      with torch.no_grad():
        return self.model(x)
    logits = getattr(self, f"_step_{self.method}")(x)
    if self.eval_order == "after":
      with torch.no_grad():
        logits = self.model(x)
    return logits.detach()

  def _step_tent(self, x):
    out = self.model(x)
    loss = softmax_entropy(out).mean(0)
    self.opt.zero_grad()
    loss.backward()
    self.opt.step()
    return out

  def _step_sar(self, x):
    self.opt.zero_grad()
    out = self.model(x)
    ent = softmax_entropy(out)
    mask1 = ent < self.margin
    masked_mean(ent, mask1).backward()
    # SAM first step: e = rho * g / (||g|| + 1e-12), global norm.
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
    scale = self.rho / (torch.norm(torch.stack([g.norm(p=2) for g in grads]), p=2) + 1e-12)
    old = [p.detach().clone() for p in self.params]
    with torch.no_grad():
      for p, g in zip(self.params, grads):
        p.add_(g * scale)
    self.opt.zero_grad()
    ent2 = softmax_entropy(self.model(x))[mask1]
    mask2 = ent2 < self.margin
    loss2 = masked_mean(ent2, mask2)
    if bool(mask2.any()):
      v = float(loss2.item())
      self.ema = v if self.ema is None else 0.9 * self.ema + 0.1 * v
    loss2.backward()
    with torch.no_grad():
      for p, o in zip(self.params, old):
        p.copy_(o)
    self.opt.step()
    if self.ema is not None and self.ema < 0.2:
      with torch.no_grad():
        for p, s in zip(self.params, self.source[0]):
          p.copy_(s)
      self.opt.load_state_dict(copy.deepcopy(self.source[1]))  # SAR's code keeps the EMA after a reset
    return out

  def _step_pcsr(self, x):
    out = self.model(x)
    ent = softmax_entropy(out)
    mask = ent < self.margin
    l_sim = -torch.stack([rc.similarity for rc in self.recals]).mean(0).mean()
    loss = masked_mean(ent, mask) + (mask.sum() / x.shape[0]) * l_sim
    self.opt.zero_grad()
    loss.backward()
    self.opt.step()
    return out

  def adapted_state(self) -> dict[str, np.ndarray]:
    """The adapted params as numpy, timm-named (LayerNorms) or ``recal_i.{dsn,fgn}.{weight,bias}``."""
    if self.method == "pcsr":
      return {f"recal_{i}.{k}": v.detach().numpy().copy() for i, rc in enumerate(self.recals)
              for k, v in rc.state_dict().items() if not k.startswith("similarity")}
    names = {id(p): n for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().numpy().copy() for p in self.params}


def load_recalibrator(rc: Recalibrator, p: Mapping[str, Any]) -> None:
  """Loads Flax recalibrator params (``{'dsn': {'kernel', 'bias'}, 'fgn': ...}``) into a torch Recalibrator."""
  with torch.no_grad():
    for name in ("dsn", "fgn"):
      lin = getattr(rc, name)
      lin.weight.copy_(torch.from_numpy(np.asarray(p[name]["kernel"]).T.copy()))
      lin.bias.copy_(torch.from_numpy(np.asarray(p[name]["bias"]).copy()))
