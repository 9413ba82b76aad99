"""DCT (domain-conditioned transformer) in PyTorch, written from the official ``yushuntang/DCT`` code (HEAD d9384a4;
``dct.py``, ``main.py``, ``sam.py`` and ``models/dct_attention.py`` are unchanged since the first commit 4111c50),
run as ``run.sh`` runs it (``--method dct --model vitbase_timm --exp_type normal --test_batch_size 64``).

The module (``models/dct_attention.py:6-27``, a subclass of timm 0.6.11's ``Attention``), on the attention input
x [B, N, C] (in a timm block that is ``norm1`` of the residual stream):

* q, k, v from the block's ``qkv`` as timm does, [B, H, N, C/H] each (``:14-15``);
* the generator ``domain_conditioner_generator = Linear(C, 3C)`` (``:10``) reads row 0 of x, each sample's own
  normed CLS token, and its output is split exactly like ``qkv``'s: ``reshape(B, 1, 3, H, C/H)`` (``:16``), so
  output features [0, C) are the extra query, [C, 2C) the extra key, [2C, 3C) the extra value, head-major;
* the extra token is appended **at the end** (index N) of q, k and v (``:18``);
* ``softmax(q @ k^T * C/H ** -0.5)`` over the N + 1 keys (``:20-21``), times v, heads merged, and the extra
  output row (index N) dropped (``:24``), then ``proj`` (``:25``). Dropouts are 0.

`DCTAttention` computes this with the block's own ``qkv``/``proj`` modules (shared, not copied), so its state
dict keys are timm's (``blocks.i.attn.qkv.weight`` ...) plus ``blocks.i.attn.generator.{weight,bias}``.

The extra query row only produces the dropped output row (the softmax is row-wise), so the q third of the generator
(weight rows [0, C), bias [0, C)) gets an exactly zero gradient: every backward step through the dropped row is a
product with exact zeros. With weight decay 0, SAM's ``e`` and the SGD step are then exactly 0 on it, and it keeps
its initial (random) value to the bit (checked: a gradient of exactly 0 after one backward, bit-equal after 5
steps, while the k and v thirds move).

Model (``main.py:299-312``): ``timm.create_model('vit_base_patch16_224', pretrained=True)``, then
``block.attn = DCT_Attention()`` for blocks 0-8 (``net.blocks[:9]``; fresh modules, PyTorch's default random
init), then the augreg npz reloaded into every timm tensor (``main.py:83-162``), qkv/proj included; the generators
keep their random init. ``vitlarge_timm`` (``main.py:306-312``) does the same for ``net.blocks[:21]`` of
``vit_large_patch16_224`` (24 blocks). Here ``blocks`` defaults to those two by the model's depth (``[:21]`` at 24
blocks, ``[:9]`` otherwise) and ``generator_init`` ({block: (weight [3C, C], bias [3C])}) supplies the random
values.

Parameters (``dct.py:114-155``): walking ``model.named_modules()``, a module is skipped when its name holds any of
``layer4``, ``blocks.9``, ``blocks.10``, ``blocks.11``, ``blocks.21``, ``blocks.22``, ``blocks.23`` or ``norm.``,
or is ``norm`` (``dct.py:123-142``, `official_name_test`); of the others, one group per tensor: weight and bias of
every LayerNorm at ``args.lr`` = 0.001 * B / 64 (``main.py:305``), and the generator weight and bias of every
``Attention`` at ``args.dct_lr`` = 0.01 (``main.py:200``; 0.003 for ImageNet-R, ``main.py:229``). At ViT-B's 12
blocks: the norms and generators of blocks 0-8. At ViT-L's 24: the generators of blocks 9-11 exist (``[:21]``)
but are skipped by the name test, so they run at their random init and never move; blocks 0-8 and 12-20 adapt
(72 LayerNorm tensors and 36 generator tensors, 108). The walk order per block is norm1, attn (generator), norm2;
it is kept here (it only orders the terms of SAM's gradient norm). ``--LN_lr`` (``main.py:199``) is never read. There is no lr doubling under bs1: the
doubling of ``main.py:322-324`` is for ``--method sar`` only. One SAM (``sam.py``, rho 0.05, not adaptive) over SGD
with momentum 0.9 (``main.py:383-384``; every group carries its lr).

One batch (``dct.py:44-54`` calling ``forward_and_adapt_dct``, ``dct.py:70-111``), exactly SAR's step:
  1. zero_grad; forward 1 (``:80``): **the reported prediction** (returned at ``:111``, ``:54``), before the update;
     entropy; keep ``ent < E0`` (``:83``, E0 = ``--sar_margin_e0`` 0.4 ln 1000, ``main.py:197,385``); mean;
     backward.
  2. SAM ``first_step(zero_grad=True)`` (``:88``): every param += rho * g / (||g|| + 1e-12), one norm over all
     groups (LayerNorms and generators together).
  3. forward 2 at w + e (``:92``); the entropies of filter 1's samples, filtered again by ``< E0`` (``:93-96``); if
     their mean is not NaN, ema <- mean (first value) or 0.9 ema + (1 - 0.9) mean (``:14-19,97-98``); backward;
     SAM ``second_step(zero_grad=True)`` (``:101-102``): back to w, then the SGD step with the gradient at w + e.
  4. ``ema < 0.2`` (``:107``) -> reset (``dct.py:50-51,56-61,158-168``): ``model.load_state_dict`` and
     ``optimizer.load_state_dict`` of the copies taken when ``DCT`` was built (``dct.py:40-41``, after the module
     swap and the npz load), so the model copy holds the generators' initial random values and the reset restores
     them too. SAM's state dict holds only its ``old_p`` copies (none at construction), and ``sam.py:60-62``
     re-points the inner SGD at the reloaded groups: the SGD momentum buffers survive the reset
     (`benchmarks.torch_reference.SAM`). ``reset()`` sets ema to None, but ``DCT.forward`` writes the step's
     (pre-reset) ema back (``dct.py:52``): the ema is kept.
Cost 2F + 2B.

Ambiguities and deviations (all value-preserving unless said):
  - ``reset_constant``: ``DCT`` takes ``reset_constant_em=0.2`` and passes it on, but the test is the literal
    ``ema < 0.2`` (``dct.py:107``). Here ``reset_constant`` (default 0.2) is that literal.
  - The EMA weight is written ``(1 - 0.9)`` as in ``dct.py:19`` (0.09999999999999998 in float64, not 0.1).
  - ``main.py:386-387`` calls ``net.reset()`` right after building ``DCT``: a reload of the state just copied, a
    no-op; it is not repeated here.
  - The official sets ``model.train()`` (``dct.py:174``), but ``validate`` calls ``model.eval()`` (``main.py:35``)
    and every dropout / drop-path rate is 0: the model runs in eval mode here.
  - ``configure_model`` (``dct.py:178-187``) enables grads on every LayerNorm, blocks 9-11's and the final norm's
    included, which no optimizer holds: they stay frozen here.
  - An empty filter gives the official a NaN loss whose backward leaves zero gradients; `masked_mean` gives 0 with
    the same zero gradients (the SGD step still moves params through momentum). The EMA skips it.
  - The official runs torch 1.9, whose ``zero_grad`` keeps zero tensors; every adapted tensor gets a gradient on
    every backward (the zero q third included), so torch 2's ``None`` grads change nothing.
  - ``blocks``: the official swaps ``[:9]`` or ``[:21]``; another list is this reference's argument, the name
    test applied to it as to the official's.
  - The paper speaks of conditioning "each layer" and of the model "updated before making a prediction"; the code
    conditions 9 blocks and reports forward 1's prediction, before the update. The code is followed.
  - ``rho`` and the margin are arguments; the official uses SAM's default 0.05 and 0.4 ln 1000. The npz
    normalization (0.5/0.5, ``dataset/selectedRotateImageFolder.py:16``) is the caller's business.

    ref = Reference(model, batch_size, margin, generator_init)   # model: timm VisionTransformer, eval mode
    logits = ref.step(x_nchw)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from benchmarks.torch_reference import SAM, SARStep

# dct.py:123-140: a module whose name holds one of these is skipped ("blocks9-11 for Vit-Base and blocks21-23 for
# Vit-large"), as is the final ``norm`` (dct.py:141-142).
SKIPPED_NAME_PARTS = ("layer4", "blocks.9", "blocks.10", "blocks.11", "blocks.21", "blocks.22", "blocks.23", "norm.")


def official_name_test(name: str) -> bool:
  """Whether ``collect_params`` (dct.py:121-142) looks at the module named ``name``: substring tests, as there."""
  return not any(part in name for part in SKIPPED_NAME_PARTS) and name != "norm"


class DCTAttention(nn.Module):
  """``DCT_Attention`` (``models/dct_attention.py:12-27``) on a timm ``Attention``'s own ``qkv`` and ``proj``,
  with the domain-conditioner generator ``Linear(C, 3C)`` as ``generator``."""

  def __init__(self, attn: nn.Module, generator: nn.Linear):
    super().__init__()
    assert isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity), "no qk-norm in DCT"
    assert isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity), "no scale-norm in DCT"
    assert getattr(attn, "gate", None) is None, "no gated attention in DCT"
    assert attn.attn_drop.p == 0 and attn.proj_drop.p == 0, "dropout 0 expected"
    self.num_heads = attn.num_heads
    self.head_dim = attn.head_dim
    assert self.num_heads * self.head_dim == attn.qkv.in_features, "DCT's reshape needs C = H * head_dim"
    self.scale = attn.scale  # head_dim ** -0.5, as timm 0.6.11's Attention
    self.qkv = attn.qkv  # shared with the block, so the pretrained weights are the block's own
    self.proj = attn.proj
    self.generator = generator

  def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
              **kwargs) -> torch.Tensor:
    assert attn_mask is None and not is_causal, "DCT's attention has no mask"
    b, n, c = x.shape
    h, hd = self.num_heads, self.head_dim
    q, k, v = self.qkv(x).reshape(b, n, 3, h, hd).permute(2, 0, 3, 1, 4).unbind(0)  # dct_attention.py:14-15
    # dct_attention.py:16-17: the generator on each sample's row 0 (the normed CLS token), split as qkv is.
    qe, ke, ve = self.generator(x[:, 0, :]).reshape(b, 1, 3, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
    q, k, v = torch.cat((q, qe), dim=2), torch.cat((k, ke), dim=2), torch.cat((v, ve), dim=2)  # appended last, :18
    attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # :20-21, scale after the product
    out = (attn @ v).transpose(1, 2).reshape(b, n + 1, c)[:, :-1, :]  # :24, the extra token's row dropped
    return self.proj(out)  # :25


class Reference(SARStep):
  """DCT on a timm ViT: the domain-conditioned attention in ``blocks``, then SAR's step on the LayerNorms and
  generators that the official name test keeps, the prediction from the first forward."""

  def __init__(self, model: nn.Module, batch_size: int, margin: float,
               generator_init: Mapping[int, tuple[np.ndarray, np.ndarray]], reset_constant: float = 0.2,
               lr_norm: float | None = None, lr_generator: float = 0.01, rho: float = 0.05,
               blocks: Sequence[int] | None = None):
    self.model = model
    self.margin = margin
    self.reset_constant = reset_constant
    self.ema: float | None = None
    self.resets = 0
    self.counts: list[tuple[int, int]] = []  # (first filter, second filter) per step
    lr_norm = lr_norm if lr_norm is not None else 0.001 / 64 * batch_size  # main.py:305, no bs1 doubling
    model.requires_grad_(False)
    if blocks is None:  # main.py:302 (vitbase_timm, net.blocks[:9]) and 309 (vitlarge_timm, net.blocks[:21])
      blocks = range(21 if len(model.blocks) == 24 else 9)
    blocks = tuple(blocks)
    assert set(blocks) == set(generator_init), "one generator init per conditioned block"
    for i in blocks:
      attn = model.blocks[i].attn
      d = attn.qkv.in_features
      gen = nn.Linear(d, 3 * d, bias=True).to(device=attn.qkv.weight.device, dtype=attn.qkv.weight.dtype)
      w, bias = generator_init[i]
      assert tuple(np.shape(w)) == (3 * d, d) and tuple(np.shape(bias)) == (3 * d,), "generator is [3D, D], [3D]"
      with torch.no_grad():
        gen.weight.copy_(torch.as_tensor(np.asarray(w), dtype=gen.weight.dtype))
        gen.bias.copy_(torch.as_tensor(np.asarray(bias), dtype=gen.bias.dtype))
      model.blocks[i].attn = DCTAttention(attn, gen)  # same slot in the block's _modules: named_modules order kept
    # dct.py:114-155: the walk over named_modules, the name test, then one group per tensor: LayerNorms at lr_norm,
    # each conditioned attention's generator weight and bias at lr_generator.
    groups, self.params = [], []
    for nm, m in model.named_modules():
      if not official_name_test(nm):
        continue
      if isinstance(m, nn.LayerNorm):
        picked, lr = [m.weight, m.bias], lr_norm
      elif isinstance(m, DCTAttention):
        picked, lr = [m.generator.weight, m.generator.bias], lr_generator
      else:
        continue
      for p in picked:
        groups.append({"params": [p], "lr": lr})
        self.params.append(p)
    for p in self.params:
      p.requires_grad_(True)
    self.opt = SAM(groups, torch.optim.SGD, rho=rho, momentum=0.9)  # main.py:383-384
    # dct.py:40-41: the copies a reset reloads, taken with the generators at their initial values.
    self.model_state = copy.deepcopy(model.state_dict())
    self.opt_state = copy.deepcopy(self.opt.state_dict())

  def step(self, x: torch.Tensor) -> torch.Tensor:
    """``forward_and_adapt_dct`` (dct.py:70-111) and the reset of ``DCT.forward`` (dct.py:48-52); returns forward
    1's logits, the official prediction."""
    return self._sar_step(x)

  def adapted_state(self) -> dict[str, np.ndarray]:
    """Every adapted tensor by name: timm's for the LayerNorms (``blocks.0.norm1.weight`` ...) and
    ``blocks.{i}.attn.generator.{weight,bias}`` ([3D, D] and [3D], torch Linear layout) for the generators."""
    names = {id(p): n for n, p in self.model.named_parameters()}
    return {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.params}
