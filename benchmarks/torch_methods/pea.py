"""PEA in PyTorch, written from its official code (``TheMaXiao/PEA_TTA`` @ e8b98da: ``pea_vit.py``
``compute_source_stats_vit`` l. 65-148, ``_build_source_cov_groups_vit`` l. 151-169, ``PEAStatsViT`` l. 185-258,
``PEAViT`` l. 265-383, the views l. 390-433, pass 1 l. 441-524, ``pea_vit_infer`` l. 531-596,
``entropy_from_logits`` l. 599-602; the loop and its reset policy ``main_vit.py`` l. 319-379).

Settings of the README's ViT command: alignment on all tokens, pass-1 weights from the class tokens, views
original + centre crop 0.9 + flip, ``microbatch_variants`` 1, ``update_every`` 1. One change for the agreement
test: ``step(x, valid)`` drops the padding rows of a ragged batch first (the official loader hands it the short
batch). ``counts`` records, per step, how many blocks were aligned, how many of those updates were drift
spikes, how many blocks pass 1 skipped, and whether the entropy reset fired.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.transforms import functional as TF

SKIP = 1e-3


def sqrt_psd(m: torch.Tensor) -> torch.Tensor:
  m = 0.5 * (m.float() + m.float().T)
  lam, v = torch.linalg.eigh(m)
  return v @ torch.diag(torch.sqrt(torch.clamp(lam, min=0.0))) @ v.T


def inv_sqrt_psd(a: torch.Tensor, eps: float) -> torch.Tensor:
  a = 0.5 * (a.float() + a.float().T)
  lam, v = torch.linalg.eigh(a)
  return (v * torch.clamp(lam, min=eps).rsqrt().unsqueeze(0)) @ v.T


def slices(d: int, g: int) -> list[tuple[int, int]]:
  return [(s, min(s + g, d)) for s in range(0, d, g)]


@torch.no_grad()
def source_stats(model: nn.Module, batches: list[torch.Tensor], reg: float = 1e-5):
  """Per block, over all tokens: the mean, the Welford variance and the root of the batch-centred covariance
  (one loop over the same batches per block, as the official)."""
  means, vars_, roots = [], [], []
  for blk in model.blocks:
    captured = {}
    h = blk.register_forward_hook(lambda _m, _i, out: captured.__setitem__("x", out.detach().float()))
    n, mean, m2, c2 = 0, None, None, None
    for x in batches:
      model(x)
      t = captured["x"].reshape(-1, captured["x"].shape[-1])
      if mean is None:
        d = t.shape[1]
        mean, m2, c2 = torch.zeros(d), torch.zeros(d), torch.zeros(d, d)
      total = n + t.shape[0]
      delta = t.mean(0) - mean
      mean += delta * (t.shape[0] / max(total, 1))
      m2 += ((t - (mean - delta)) * (t - mean)).sum(0)
      c = t - t.mean(0, keepdim=True)
      c2 += c.T @ c
      n = total
    h.remove()
    means.append(mean.unsqueeze(0))
    vars_.append((m2 / (n - 1)).unsqueeze(0))
    roots.append(sqrt_psd(c2 / (n - 1) + reg * torch.eye(c2.shape[0])))
  return means, vars_, roots


class Stats:
  """``PEAStatsViT``: EMA target statistics per block with drift spikes, and the entropy EMA."""

  def __init__(self, momentum=0.02, alpha=0.2, gamma=4.0, entropy_threshold=1.0, reg=1e-5):
    self.momentum, self.alpha, self.gamma, self.threshold, self.reg = momentum, alpha, gamma, entropy_threshold, reg
    self.mu, self.cov, self.drift = {}, {}, {}
    self.entropy_smooth: Optional[float] = None

  def update(self, i: int, x: torch.Tensor) -> bool:
    mu_b = x.mean(0, keepdim=True)
    xc = x - mu_b
    cov_b = xc.T @ xc / max(xc.shape[0] - 1, 1)
    cov_b = cov_b + self.reg * torch.eye(cov_b.shape[0])
    if i not in self.mu:
      self.mu[i], self.cov[i], self.drift[i] = mu_b, cov_b, 0.0
      return False
    drift = (mu_b - self.mu[i]).abs().mean().item()
    smoothed = self.alpha * drift + (1.0 - self.alpha) * self.drift[i]
    self.drift[i] = smoothed
    spike = smoothed > 1e-6 and drift > self.gamma * smoothed
    if spike:
      self.mu[i], self.cov[i] = mu_b, cov_b
    else:
      m = self.momentum
      self.mu[i] = m * mu_b + (1.0 - m) * self.mu[i]
      self.cov[i] = m * cov_b + (1.0 - m) * self.cov[i]
    return spike


def view(x: torch.Tensor, name: str, ratio: float) -> torch.Tensor:
  if name == "orig":
    return x
  h, w = x.shape[-2:]
  if "centercrop" in name:
    x = TF.center_crop(x, [max(1, int(round(h * ratio))), max(1, int(round(w * ratio)))])
    x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
  if "hflip" in name:
    x = torch.flip(x, dims=[3])
  return x


class Reference:
  """PEA on a timm ViT: ``step(x)`` runs both passes on the views and returns the mean of their logits."""

  def __init__(self, model: nn.Module, batch_size: int, source_batches: list[torch.Tensor], group_size: int = 768,
               eps: float = 1e-5, names=("orig", "centercrop", "hflip"), ratio: float = 0.9, **stats_kw):
    del batch_size  # a short batch is its own size
    self.model, self.group, self.eps, self.names, self.ratio = model.eval(), group_size, eps, names, ratio
    self.stats_kw = stats_kw
    self.src_mean, self.src_var, roots = source_stats(model, source_batches, stats_kw.get("reg", 1e-5))
    self.src_groups = []
    for r in roots:
      cov = r @ r.T
      self.src_groups.append([sqrt_psd(cov[s:e, s:e].contiguous()) for s, e in slices(cov.shape[0], group_size)])
    self.stats = Stats(**stats_kw)
    self.counts: list[tuple[int, int, int, int]] = []

  def reset(self) -> None:
    self.stats = Stats(**self.stats_kw)

  def weights(self, x: torch.Tensor) -> list[float]:
    sums, squares, count = {}, {}, {}

    def hook(i):
      def fn(_m, _i, out):
        t = out.detach().float()[:, 0, :]
        sums[i] = sums.get(i, 0) + t.sum(0, keepdim=True)
        squares[i] = squares.get(i, 0) + (t * t).sum(0, keepdim=True)
        count[i] = count.get(i, 0) + t.shape[0]
      return fn

    handles = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(self.model.blocks)]
    for name in self.names:
      self.model(view(x, name, self.ratio))
    for h in handles:
      h.remove()
    scores = torch.empty(len(self.model.blocks))
    for i in range(len(scores)):
      t = max(1, count[i])
      mu = sums[i] / t
      var = (squares[i] / t - mu * mu).clamp_min(0.0) * (t / max(1, t - 1))
      scores[i] = torch.linalg.vector_norm((self.src_mean[i] - mu).reshape(-1)) + \
          torch.linalg.vector_norm((self.src_var[i] - var).reshape(-1))
    lo, hi = scores.min(), scores.max()
    normed = (scores - lo) / (hi - lo) if float(hi) > float(lo) else torch.zeros_like(scores)
    return [float(v) for v in normed]

  def aligned(self, x: torch.Tensor, w: list[float], tally: list[int]) -> torch.Tensor:
    m = self.model
    x = m.patch_embed(x)
    x = torch.cat((m.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + m.pos_embed
    for i, blk in enumerate(m.blocks):
      x = blk(x)
      if w[i] < SKIP:
        continue
      tokens = x.reshape(-1, x.shape[-1])
      spike = self.stats.update(i, tokens)
      tally[0] += 1
      tally[1] += int(spike)
      xc = tokens - self.stats.mu[i]
      y = torch.empty_like(tokens)
      for (s, e), src in zip(slices(tokens.shape[-1], self.group), self.src_groups[i]):
        y[:, s:e] = xc[:, s:e] @ inv_sqrt_psd(self.stats.cov[i][s:e, s:e].contiguous(), self.eps) @ src
      y = y + self.src_mean[i]
      x = x + (w[i] * (y - tokens)).view_as(x)
    return m.head(m.norm(x)[:, 0])

  @torch.no_grad()
  def step(self, x: torch.Tensor, valid: Optional[np.ndarray] = None) -> torch.Tensor:
    if valid is not None:
      x = x[torch.from_numpy(valid)]
    w = self.weights(x)
    tally = [0, 0]
    logits = sum(self.aligned(view(x, n, self.ratio), w, tally) for n in self.names) / len(self.names)
    p = torch.softmax(logits.float(), dim=1)
    ent = float(-(p * p.clamp_min(1e-12).log()).sum(dim=1).mean())
    st = self.stats
    reset = st.entropy_smooth is not None and ent > st.entropy_smooth + st.threshold
    if reset:
      self.reset()
    st = self.stats
    st.entropy_smooth = ent if st.entropy_smooth is None else st.alpha * ent + (1 - st.alpha) * st.entropy_smooth
    self.counts.append((tally[0], tally[1], sum(v < SKIP for v in w), int(reset)))
    return logits
