"""VCT (visual conditioning tokens) in PyTorch, written from the official ``yushuntang/VCT`` code (HEAD 3124dfb;
``vct.py``, ``main.py``, ``sam.py`` and ``models/vision_transformer.py`` are unchanged since 1463aff).

The model (``models/vision_transformer.py:452-453,537-538``): the pretrained ``cls_token`` [1,1,D] and a new
zero-initialised ``instance_token`` [B,1,D] (one row per batch slot, B = ``--test_batch_size``) enter as
``cls + instance_token[:n]`` concatenated before the patches, then the position embedding is added. Everything
else is timm's ViT. `VCTViT` wraps the timm model with that token; the timm model itself is not edited.

Parameters (``vct.py:111-153``, one group per tensor, in this order): ``cls_token`` at ``--cls_token_lr``
0.005, ``instance_token`` at ``--instance_token_lr`` 0.01, then weight and bias of every LayerNorm whose module
name holds none of ``blocks.9``/``blocks.10``/``blocks.11``/``norm.`` and is not ``norm`` (blocks 0-8 for
ViT-B) at ``args.lr`` = 0.001 * B / 64 (``main.py:196``), doubled under ``--exp_type bs1`` (``main.py:208-210``;
only this lr, the token lrs are not doubled). All groups in SAR's SAM (``sam.py``) over SGD with momentum 0.9
and rho 0.05 (``main.py:340-342``: no lr, no rho given; every group carries its lr).

One batch (``vct.py:41-56`` calling ``forward_and_adapt_vct``, ``vct.py:72-108``), exactly SAR's step:
  1. zero_grad; forward 1; entropy; keep ``ent < E0`` (E0 = ``--sar_margin_e0`` 0.4 ln 1000); mean; backward.
  2. SAM ``first_step``: every param += rho * g / (||g|| + 1e-12), one norm over all groups (the tokens too).
  3. forward 2 at w + e; entropies of the first filter's samples, filtered again by ``< E0``; the mean of those
     is the loss; if not NaN, ema <- loss (first value) or 0.9 ema + 0.1 loss; backward; SAM ``second_step``
     (back to w, then the SGD step with the gradient taken at w + e).
  4. ``ema < 0.2`` -> reset: ``model.load_state_dict`` and ``optimizer.load_state_dict`` of the copies taken at
     construction (``vct.py:38-39,58-63,156-166``). The model copy holds every tensor of the model, the new
     ``instance_token`` (zeros) and the pretrained ``cls_token`` included; SAM's state dict holds only its
     ``old_p`` copies, and ``sam.py:65-67`` re-points the base SGD at the reloaded groups, so the SGD momentum
     buffers survive the reset. ``reset()`` sets ema to None, but ``VCT.forward`` then writes the pre-reset ema
     back (``vct.py:47-49``): the ema is kept.
  5. forward 3 (``vct.py:50``) with the updated (or reset) params: **the reported prediction**.
  6. ``instance_token``'s grad and data zeroed (``vct.py:51-55``); its SGD momentum buffer stays, so the next
     batch's token is ``0 - lr_token * (0.9 buf + g)``.
Cost 3F + 2B.

Ambiguities and deviations (all value-preserving unless said):
  - ``reset_constant``: the official ``VCT`` takes ``reset_constant_em=0.2`` but never reads it; the test is the
    literal ``ema < 0.2`` (``vct.py:104``). Here ``reset_constant`` (default 0.2) is that literal.
  - The third forward runs with grad enabled in the official (neither ``VCT.forward`` nor ``main.py:352-359``
    disables it) but nothing is backpropagated from it; here it runs under ``torch.no_grad``.
  - ``param.grad.data.zero_()`` (``vct.py:54``) needs a zero tensor, not None, after ``second_step(zero_grad=True)``,
    i.e. torch < 2.0 (``zero_grad`` keeps zero tensors); under torch >= 2.0 it would raise. At that point the grad
    is zero either way (no backward after forward 3), so here it is a no-op when the grad is None.
  - An empty filter: the official mean of no entropies is NaN, whose backward gives zero grads; `masked_mean` gives
    a zero loss with the same zero grads (the SGD step still moves params through momentum). The EMA skips it.
  - ``configure_model`` (``vct.py:169-185``) also sets requires_grad on the LayerNorms of blocks 9-11 and the final
    norm, which are never in the optimizer: their grads have no effect, so they stay frozen here.
  - The official model runs in train mode (``vct.py:171``); with dropout and drop-path 0 that is eval mode.
  - The default doubles the LayerNorm lr when ``batch_size == 1`` (the official keys it to ``--exp_type bs1``,
    the only setting with B = 1, ``main.py:157-159``).
  - A batch smaller than B uses the first n token rows (``instance_token[:x.shape[0]]``), as the official does.
  - ``rho`` and the margin are arguments; the official uses SAM's default 0.05 and 0.4 ln 1000.

    ref = Reference(model, batch_size, margin)   # model: timm VisionTransformer, class token, global_pool='token'
    logits = ref.step(x_nchw)
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from benchmarks.torch_reference import SAM, SARStep, sar_layernorms


class VCTViT(nn.Module):
  """A timm ``VisionTransformer`` with VCT's instance token added to the class token before the position embedding
  (``models/vision_transformer.py:537-538``). ``state_dict`` holds ``vit.*`` and ``instance_token``."""

  def __init__(self, vit: nn.Module, batch_size: int):
    super().__init__()
    assert vit.cls_token is not None and getattr(vit, "reg_token", None) is None, "VCT needs a lone class token"
    assert not vit.no_embed_class and not getattr(vit, "dynamic_img_size", False), "pos_embed must cover the cls"
    assert vit.global_pool == "token", "VCT's head reads the class token"
    self.vit = vit
    self.instance_token = nn.Parameter(torch.zeros(batch_size, 1, vit.embed_dim, device=vit.cls_token.device))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    v = self.vit
    x = v.patch_embed(x)  # [n, N, D]
    n = x.shape[0]
    cls = v.cls_token.expand(n, -1, -1) + self.instance_token[:n]
    x = torch.cat((cls, x), dim=1) + v.pos_embed
    x = v.norm_pre(v.patch_drop(v.pos_drop(x)))
    x = v.norm(v.blocks(x))
    return v.forward_head(x)  # token pool, fc_norm (Identity), head


class Reference(SARStep):
  """VCT on a timm ViT: SAR's step on the cls token, the per-slot instance token and LayerNorms 0-8, then the
  prediction from a third forward, then the instance token zeroed."""

  def __init__(self, model: nn.Module, batch_size: int, margin: float, reset_constant: float = 0.2,
               lr_norm: float | None = None, lr_cls: float = 0.005, lr_token: float = 0.01, rho: float = 0.05):
    self.margin = margin
    self.reset_constant = reset_constant
    self.ema: float | None = None
    self.resets = 0
    self.counts: list[tuple[int, int]] = []  # (first filter, second filter) per step
    self.instance_token_used: np.ndarray | None = None  # the token forward 3 saw, before the zeroing
    lr_norm = lr_norm if lr_norm is not None else 0.001 / 64 * batch_size * (2 if batch_size == 1 else 1)
    model.requires_grad_(False)
    self.model = VCTViT(model, batch_size)
    norms = sar_layernorms(model)  # the name filter of vct.py:119-132 on timm's names: blocks 0-8 norm1/norm2
    self.params = [model.cls_token, self.model.instance_token] + norms
    for p in self.params:
      p.requires_grad_(True)
    groups = ([{"params": [model.cls_token], "lr": lr_cls}, {"params": [self.model.instance_token], "lr": lr_token}]
              + [{"params": [p], "lr": lr_norm} for p in norms])  # vct.py:134-151, one group per tensor
    self.opt = SAM(groups, torch.optim.SGD, rho=rho, momentum=0.9)  # main.py:340-341
    # vct.py:38-39: the copies a reset reloads, taken after the tokens exist and the optimizer is built.
    self.model_state = copy.deepcopy(self.model.state_dict())
    self.opt_state = copy.deepcopy(self.opt.state_dict())

  def step(self, x: torch.Tensor) -> torch.Tensor:
    self._sar_step(x)  # forward_and_adapt_vct (vct.py:77-106) and the reset of VCT.forward (vct.py:47-49)
    with torch.no_grad():
      logits = self.model(x)  # vct.py:50, the reported prediction
      token = self.model.instance_token
      self.instance_token_used = token.detach().cpu().numpy().copy()
      if token.grad is not None:  # vct.py:51-55; the SGD momentum buffer of the token is kept
        token.grad.zero_()
      token.zero_()
    return logits.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    """Every adapted tensor: ``cls_token`` [1,1,D], ``instance_token`` [B,1,D] (zero after each step, as the
    official leaves it; see ``instance_token_used``) and the LayerNorms by their timm names."""
    names = {id(p): n.removeprefix("vit.") for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.params}
