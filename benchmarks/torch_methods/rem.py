"""REM (Ranked Entropy Minimization, ICML 2025) in PyTorch, written as its official ImageNet-C code runs it
(``pilsHan/rem`` at d757218: ``imagenet/rem.py``, ``imagenet/imagenetc.py``, ``imagenet/cfgs/vit/rem.yaml``,
``imagenet/robustbench/model_zoo/rem_vit.py``, ``imagenet/robustbench/model_zoo/vision_transformer_rem.py``).

One step (``REM.forward_and_adapt``, ``rem.py:51-112``), ratios ``mn = [i * m for i in range(n)]`` (``rem.py:30``),
so 0 / 10 / 20 % for m = 0.1, n = 3:

1. Full forward of ``x`` with grad, in train mode (``configure_model``, ``rem.py:182``, and ``rem.py:93`` after
   every step), returning the last block's attention map: softmax(q k^T * scale) over all N+1 keys, after
   ``attn_drop`` (``vision_transformer_rem.py:188-195``; only the last block returns it, ``rem_vit.py:310-314``).
   The score is the head mean, CLS query row, patch key columns, no renormalisation
   (``attn.mean(dim=1)[:, 0, 1:]``, ``rem.py:54``).
2. In eval mode (``rem.py:82``), each view with ratio ``m > 0`` keeps ``int(N * (1 - m))`` patches
   (``rem.py:88``; N hard-coded 196 there, the model's patch count here), the ones of *lowest* attention,
   ``topk(score, num_keep, largest=False).indices`` (``rem.py:89``): sorted by ascending score, so the kept
   tokens enter the blocks in that order, not spatially (the CLS output does not depend on the order). The
   ratio-0 view is the full forward itself (``rem.py:84-86``). Tokens are gathered after the position
   embedding, CLS kept in front, then ``pos_drop`` (``rem_vit.py:294-308``); the views run with grad.
3. MCL (``rem.py:95-99``): for i = 1..n-1, CE(sg p_0 -> o_i) + sum_{0<j<i} CE(sg p_j -> o_i), each
   ``-(softmax(target) * log_softmax(o_i)).sum(1).mean()`` (``rem.py:115-118``): for n = 3, in this order,
   CE(sg p0, o1) + CE(sg p0, o2) + CE(sg p1, o2).
4. ERL (``rem.py:101-105``): sum_{i<j} mean(relu(H_i - sg H_j + margin)) with H the softmax entropy
   (``rem.py:121-126``, = `softmax_entropy`), in the order (0,1), (0,2), (1,2): the less masked view is pushed
   below the more masked one. margin = MARGIN * log(1000) (``rem.py:32``; 0 in ``rem.yaml``).
5. loss = MCL + lamb * ERL; ``backward``, Adam ``step``, ``zero_grad`` (``rem.py:107-110``). The returned
   prediction is the full forward of step 1, before the update (``rem.py:112``), argmax-ed by
   ``clean_accuracy`` (``robustbench/utils.py:211-218``). Cost: 3 forwards + 1 backward.

Adapted: weight and bias of the LayerNorms of blocks 0-8 (``collect_params``, ``rem.py:129-159``: skips
blocks 9-11 and the final ``norm``). Adam, lr 1e-3, betas (0.9, 0.999), weight decay 0, eps torch's default
1e-8 (``imagenetc.py:72-76``, ``rem.yaml:24-33``); lr not scaled with the batch (50 there). No reset within the
continual run (episodic False; ``imagenetc.py:38-45`` resets only before the first corruption).

Differences from the official code, none of them numerical for the timm models the tests build (drop rates 0):

* ``configure_model`` (``rem.py:186-196``) turns ``requires_grad`` on for *every* parameter, the optimizer
  holding only the LayerNorms; the other grads just accumulate unused. Here only the adapted params need grad.
* The official hard-codes 196 patches and ``log(1000)``; here N = ``patch_embed.num_patches`` and
  ``log(num_classes)`` (the CIFAR copy's form, ``cifar/rem.py:113``; the same for a 1000-class head).
* The official model is its own timm-0.4.12-style ViT; here the given timm ``VisionTransformer``'s submodules
  are re-used: blocks 0..L-2 are timm's own (fused attention), the last block of the full forward is
  recomputed with an explicit softmax so that its map is available, the head is ``forward_head`` (= ``head``
  of the CLS token for ``global_pool='token'``, as ``rem_vit.py:325,329``).
* Train/eval modes are mirrored (full forward in train, views in eval, the model left in train), and only
  matter for dropout / drop-path, which are 0 here (and in the official augreg ViT-B/16).

``kept`` records, per step, one ``[B, num_keep]`` int64 array per masked view, in topk order (ascending
score; ties as torch's topk breaks them); compare ``np.sort(k, -1)`` with a JAX side that keeps positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.torch_reference import softmax_entropy


def soft_cross_entropy(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
  """Per-sample CE of the logits ``x`` against the soft target ``softmax(target)`` (``rem.py:115-118``)."""
  return -(target.softmax(1) * x.log_softmax(1)).sum(1)


def attention_with_map(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """timm's ``Attention.forward`` with an explicit softmax, returning ``(out, map [B, H, N, N])`` as the
  official ``Attention`` does (``vision_transformer_rem.py:183-195``: the map after softmax and dropout)."""
  b, n, _ = x.shape
  qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
  q, k, v = qkv.unbind(0)
  q, k = attn.q_norm(q), attn.k_norm(k)
  a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
  a = attn.attn_drop(a)
  out = (a @ v).transpose(1, 2).reshape(b, n, attn.attn_dim)
  out = attn.proj_drop(attn.proj(attn.norm(out)))
  return out, a


def block_with_map(blk: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """timm's pre-norm ``Block.forward`` returning the attention map too (``vision_transformer_rem.py:211-217``)."""
  y, a = attention_with_map(blk.attn, blk.norm1(x))
  x = x + blk.drop_path1(blk.ls1(y))
  x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
  return x, a


class Reference:
  """REM on a timm ViT (class token): LayerNorms of ``blocks``, Adam, prediction = the full forward before the
  update."""

  def __init__(self, model: nn.Module, batch_size: int, lr: float = 1e-3, mask_ratio: float = 0.1,
               num_views: int = 3, lamb: float = 1.0, margin: float = 0.0, blocks: Sequence[int] = tuple(range(9))):
    assert model.cls_token is not None and model.reg_token is None and not model.no_embed_class
    assert not getattr(model, "dynamic_img_size", False)
    self.model = model
    self.batch_size = batch_size  # the official lr does not depend on it
    self.mn = [i * mask_ratio for i in range(num_views)]  # rem.py:30, the same float arithmetic
    self.lamb = lamb
    self.margin = margin * math.log(model.head.out_features)  # rem.py:32 (log(1000) there)
    self.tokens = model.patch_embed.num_patches  # rem.py:35 (196 there)
    self.num_keeps = [None if m == 0.0 else int(self.tokens * (1 - m)) for m in self.mn]  # rem.py:84-88
    model.requires_grad_(False)
    self.params = [p for i in blocks for ln in (model.blocks[i].norm1, model.blocks[i].norm2)
                   for p in (ln.weight, ln.bias)]  # rem.py:129-159, in named_modules order
    for p in self.params:
      p.requires_grad_(True)
    self.opt = torch.optim.Adam(self.params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)  # imagenetc.py:72-76
    model.train()  # configure_model, rem.py:182
    self.kept: list[list[np.ndarray]] = []
    self.losses: list[tuple[float, float]] = []

  def _forward(self, x: torch.Tensor, keep: torch.Tensor | None = None, return_attn: bool = False):
    """``vit_rem.forward`` (``rem_vit.py:293-330``) on the timm model's submodules: embed, CLS, position
    embedding, optional gather of the ``keep`` patches, blocks (the last one's map if asked), norm, head."""
    m = self.model
    h = m.patch_embed(x)
    h = torch.cat((m.cls_token.expand(h.shape[0], -1, -1), h), dim=1) + m.pos_embed
    if keep is not None:  # rem_vit.py:301-306
      d = h.shape[-1]
      h = torch.cat((h[:, :1], torch.gather(h[:, 1:], 1, keep.unsqueeze(-1).expand(-1, -1, d))), dim=1)
    h = m.norm_pre(m.pos_drop(h))
    attn = None
    if return_attn:
      for blk in m.blocks[:-1]:
        h = blk(h)
      h, attn = block_with_map(m.blocks[-1], h)
    else:
      h = m.blocks(h)
    logits = m.forward_head(m.norm(h))
    return (logits, attn) if return_attn else logits

  def step(self, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # rem.py:51
      outputs, attn = self._forward(x, return_attn=True)  # rem.py:53, in train mode
      score = attn.mean(dim=1)[:, 0, 1:]  # rem.py:54
      outs, kept = [], []
      self.model.eval()  # rem.py:82
      for num_keep in self.num_keeps:
        if num_keep is None:
          outs.append(outputs)
        else:
          keep = torch.topk(score, num_keep, largest=False).indices  # rem.py:89
          kept.append(keep.detach().cpu().numpy().copy())
          outs.append(self._forward(x, keep=keep))  # with grad
      self.model.train()  # rem.py:93
      mcl = 0.0
      for i in range(1, len(outs)):  # rem.py:95-99
        mcl = mcl + soft_cross_entropy(outs[i], outs[0].detach()).mean()
        for j in range(1, i):
          mcl = mcl + soft_cross_entropy(outs[i], outs[j].detach()).mean()
      ents = [softmax_entropy(o) for o in outs]  # rem.py:101
      erl = 0.0
      for i in range(len(outs)):  # rem.py:102-105
        for j in range(i + 1, len(outs)):
          erl = erl + F.relu(ents[i] - ents[j].detach() + self.margin).mean()
      loss = mcl + self.lamb * erl  # rem.py:107
      if isinstance(loss, torch.Tensor):  # a float only for num_views == 1 (no masked view)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
    self.kept.append(kept)
    self.losses.append((float(torch.as_tensor(mcl).detach()), float(torch.as_tensor(erl).detach())))
    return outputs.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    names = {id(p): n for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.params}
