"""DPAL in PyTorch, written from its official code (``yushuntang/DPAL`` @ 4fa3b32: ``dpal.py``, ``main.py``,
``models/dpal_transformer.py``, ``sam.py``), run as ``run.sh`` runs it (``--prompt_deep``, one prompt token).

The prompted ViT (``models/dpal_transformer.py``) re-uses the timm model's submodules in its own forward:

* ``patch_embed``, then the CLS token concatenated and the position embedding added (``:35-49``), then the
  shallow prompt ``prompt_embeddings`` [1, 1, D] concatenated *in front of* CLS, with no position embedding
  (``:74-78``): the sequence is [prompt, CLS, patches];
* block 0 runs on it; before block i = 1..depth-1, token 0 is replaced by ``deep_prompt_embeddings[i-1]``
  (``:54-61``);
* after *every* block i (the last one included) token 0's output goes through predictor i and the result,
  the "noise", is subtracted from token 1, the CLS token (``:62-69``);
* the final norm, then the head on token 1 (``:83``, ``:87-91``).

A predictor is fc1 (D->D) -> GELU -> fc2 (D->D) -> GELU, dropout 0 (``:100-116``), every tensor filled with 0
(``:29-32``). So its output is GELU(fc2.bias), the same for every sample, and only fc2.bias ever receives a
gradient (fc2.weight's is GELU(fc1(x)) = 0, fc1's goes through fc2.weight = 0), from the entropy through CLS.
Hence the similarity term is 0 while fc2.bias is 0 (the first step, and the step after each reset) and -1
(identical rows) after; its gradient is exactly 0 at the zero init and float rounding (~1e-6, fc2.bias only)
after: it changes nothing but the loss value.

One step (``dpal.py:98-140``), the prediction being forward 2's logits (``:119``, returned at ``:140``):

1. zero both optimizers' grads (``:103-104``); forward 1 (``:106``);
2. sim = mean over the depth layers of -mean(all B x B pairwise cosines of that layer's noise, diagonal
   included) (``:109``); entropy filter at E0 (``:110-112``);
3. loss1 = mean reliable entropy + (n_reliable / test_batch_size) * sim (``:113``; ``test_batch_size`` is the
   configured batch size, 64 in ``run.sh``, 1 under bs1, ``main.py:182,251``), backward (``:114``);
4. the predictors' plain SGD step (``:116``), then SAM's ``first_step`` (``:118``; it zeroes only SAM's grads);
5. forward 2 at w + e with the updated predictors (``:119``); the entropies of the samples kept by filter 1,
   re-filtered at E0 (``:120-123``); EMA of that mean if it is not NaN (``:124-125``); backward (``:128``):
   it also accumulates into the predictors' grads, which no step uses (``:103-104`` zero them next step);
   SAM's ``second_step`` (``:130``);
6. ema < 0.2 (``:136``, a literal; ``reset_constant`` here, 0.2 by default) => reset (``:55-57,61-66``):
   the state_dict of the whole prompted model copied at construction (``:44``, ``:223-228``) and both
   optimizers' state_dicts. SAM's holds only the unperturbed copies, so its inner SGD's momentum buffers
   survive the reset (`benchmarks.torch_reference.SAM`); the predictors' SGD loses its momentum. The EMA is
   kept: ``reset`` sets it to None but ``forward`` then writes the step's value back (``:57``).

Optimizers (``main.py:410-418``, ``dpal.py:158-220``): SAM (rho 0.05, SGD momentum 0.9) over
``prompt_embeddings``, ``deep_prompt_embeddings`` and the LayerNorms of blocks 0-8, one group per tensor,
lr ``prompt_lr`` = ``norm_lr`` = 0.01 (``main.py:202,204``), not scaled with the batch; a separate
``torch.optim.SGD`` (momentum 0.9) over every predictor tensor at ``predictor_lr`` 0.01 (``main.py:205``).
E0 is ``sar_margin_e0`` = 0.4 ln 1000 (``main.py:200,418``); here ``margin`` is that absolute threshold.

Differences that do not change the values: the official sets ``model.train()`` (``dpal.py:241``) but
``validate`` calls ``model.eval()`` (``main.py:38``) and every dropout rate is 0; it also enables grads on the
LayerNorms of blocks 9-11 and the final norm (``dpal.py:252-254``), which no optimizer holds. An empty filter
gives the official a NaN loss with zero gradients; `masked_mean` gives 0 with the same zero gradients.

    ref = Reference(model, 64, 0.4 * math.log(1000), {"prompt_embeddings": p, "deep_prompt_embeddings": dp})
    logits = ref.step(images_nchw)
    ref.adapted_state()  # timm LayerNorm names, 'prompt_embeddings', 'deep_prompt_embeddings',
                         # 'predictors.{i}.fc{1,2}.{weight,bias}' (torch Linear layout [out, in])
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.torch_reference import SAM, masked_mean, sar_layernorms, softmax_entropy


class Predictor(nn.Module):
  """``models/dpal_transformer.py:100-116``: fc1 -> GELU -> fc2 -> GELU (exact GELU, dropout 0), zero-filled."""

  def __init__(self, dim: int):
    super().__init__()
    self.fc1 = nn.Linear(dim, dim)
    self.fc2 = nn.Linear(dim, dim)
    for p in self.parameters():  # :30-32
      nn.init.zeros_(p)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class PromptedViT(nn.Module):
  """DPAL_Transformer's forward (``--prompt_deep``, one prompt token) on an unmodified timm ViT."""

  def __init__(self, vit: nn.Module, prompt_init: Mapping[str, np.ndarray]):
    super().__init__()
    self.vit = vit
    dev = vit.cls_token.device

    def as_param(k: str) -> nn.Parameter:
      return nn.Parameter(torch.as_tensor(np.asarray(prompt_init[k], np.float32)).to(dev).clone())

    self.prompt_embeddings = as_param("prompt_embeddings")  # [1, 1, D] (:19-22)
    self.deep_prompt_embeddings = as_param("deep_prompt_embeddings")  # [depth-1, 1, D] (:24-28)
    depth, d = len(vit.blocks), vit.embed_dim
    assert tuple(self.prompt_embeddings.shape) == (1, 1, d), self.prompt_embeddings.shape
    assert tuple(self.deep_prompt_embeddings.shape) == (depth - 1, 1, d), self.deep_prompt_embeddings.shape
    self.predictors = nn.ModuleList([Predictor(d) for _ in range(depth)]).to(dev)  # one per block (:29)
    # The official forward_features has no norm_pre / patch_drop / register tokens (timm 0.6.11, :74-85).
    assert isinstance(getattr(vit, "norm_pre", nn.Identity()), nn.Identity)
    assert getattr(vit, "num_reg_tokens", 0) == 0 and vit.cls_token is not None
    assert vit.global_pool == "token", vit.global_pool

  def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    v = self.vit
    b = x.shape[0]
    h = v.patch_embed(x)
    cls = v.cls_token.expand(b, -1, -1)
    if v.no_embed_class:  # :36-41
      h = torch.cat((cls, h + v.pos_embed), dim=1)
    else:  # :42-47 (ViT-B: CLS first, then the position embedding on CLS and patches)
      h = torch.cat((cls, h), dim=1) + v.pos_embed
    h = v.pos_drop(h)
    h = torch.cat((self.prompt_embeddings.expand(b, -1, -1), h), dim=1)  # prompt before CLS, no pos (:77-78)
    noises = []
    for i, blk in enumerate(v.blocks):
      if i > 0:  # deep prompt replaces token 0 before blocks 1..depth-1 (:58-60)
        h = torch.cat((self.deep_prompt_embeddings[i - 1].expand(b, -1, -1), h[:, 1:]), dim=1)
      h = blk(h)
      noise = self.predictors[i](h[:, 0].clone())  # token 0 after block i (:62-67)
      noises.append(noise)
      h[:, 1] -= noise  # CLS -= P_i(token 0), in place as :69
    h = v.norm(h)  # :83
    return v.head(v.fc_norm(h[:, 1])), noises  # token 1 = CLS (:87-91)


def similarity_term(noises: list[torch.Tensor]) -> torch.Tensor:
  """``dpal.py:109``: mean over layers of -(mean of the B x B cosine matrix of the noise, diagonal included)."""
  return torch.stack([-F.cosine_similarity(n.unsqueeze(1), n.unsqueeze(0), dim=2).mean() for n in noises]).mean()


class Reference:
  """DPAL on a timm ViT: SAM over the prompts + LayerNorms 0-8, plain SGD over the predictors, forward 2's
  logits as the prediction, SAR's EMA reset restoring the prompted model and both optimizers."""

  def __init__(self, model: nn.Module, batch_size: int, margin: float, prompt_init: Mapping[str, np.ndarray],
               reset_constant: float = 0.2, lr: float = 0.01, lr_predictor: float = 0.01, rho: float = 0.05):
    self.model = model
    self.batch_size = batch_size  # args.test_batch_size, the divisor of n_reliable (dpal.py:113)
    self.margin = margin
    self.reset_constant = reset_constant
    model.requires_grad_(False)
    self.net = PromptedViT(model, prompt_init)
    self.norms = sar_layernorms(model)  # collect_params: LayerNorms but blocks 9-11's and the final norm
    # collect_params' order (dpal.py:158-207): the root module's prompt tensors first, then the LayerNorms.
    self.sam_params = [self.net.prompt_embeddings, self.net.deep_prompt_embeddings] + self.norms
    self.pred_params = list(self.net.predictors.parameters())  # collect_prodictor_params (dpal.py:209-220)
    for p in self.sam_params + self.pred_params:
      p.requires_grad_(True)
    self.opt = SAM([{"params": [p], "lr": lr} for p in self.sam_params], torch.optim.SGD, rho=rho, lr=lr,
                   momentum=0.9)  # main.py:416
    self.ad_opt = torch.optim.SGD([{"params": [p], "lr": lr_predictor} for p in self.pred_params], lr=lr_predictor,
                                  momentum=0.9)  # main.py:417
    # copy_model_and_optimizer (dpal.py:44, :223-228)
    self.model_state = copy.deepcopy(self.net.state_dict())
    self.opt_state = copy.deepcopy(self.opt.state_dict())
    self.ad_opt_state = copy.deepcopy(self.ad_opt.state_dict())
    self.ema: float | None = None
    self.resets = 0
    self.counts: list[tuple[int, int]] = []  # (filter 1, filter 2) per step
    self.sims: list[float] = []  # the similarity term (forward 1) per step

  def step(self, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
      self.opt.zero_grad()  # dpal.py:103-104
      self.ad_opt.zero_grad()
      out, noises = self.net(x)  # :106
      sim = similarity_term(noises)  # :109
      ent = softmax_entropy(out)  # :110
      mask1 = ent < self.margin  # :111
      n1 = int(mask1.sum())
      loss = masked_mean(ent, mask1) + (n1 / self.batch_size) * sim  # :112-113
      loss.backward()  # :114
      self.ad_opt.step()  # :116
      self.opt.first_step()  # :118 (zeroes SAM's grads only; the predictors' stay until the next step)
      out2, _ = self.net(x)  # :119, at w + e with the updated predictors
      ent2 = softmax_entropy(out2)[mask1]  # :120-121
      mask2 = ent2 < self.margin  # :122
      loss2 = masked_mean(ent2, mask2)  # :123
      if bool(mask2.any()):  # :124-125 (NaN loss skipped)
        v = float(loss2.item())
        self.ema = v if self.ema is None else 0.9 * self.ema + 0.1 * v
      loss2.backward()  # :128 (also accumulates into the predictors' grads, unused)
      self.opt.second_step()  # :130
    self.counts.append((n1, int(mask2.sum())))
    self.sims.append(float(sim.detach()))
    if self.ema is not None and self.ema < self.reset_constant:  # :135-138, reset at :55-56
      self.net.load_state_dict(self.model_state, strict=True)  # load_model_and_optimizer (:231-236)
      self.opt.load_state_dict(copy.deepcopy(self.opt_state))
      self.ad_opt.load_state_dict(copy.deepcopy(self.ad_opt_state))
      self.resets += 1  # the EMA is kept (:57 writes the pre-reset value back)
    return out2.detach()

  def adapted_state(self) -> dict[str, np.ndarray]:
    """Timm names for the LayerNorms, ``prompt_embeddings`` [1,1,D], ``deep_prompt_embeddings`` [depth-1,1,D],
    ``predictors.{i}.fc{1,2}.{weight,bias}`` (weight as torch's [out, in])."""
    names = {id(p): n for n, p in self.model.named_parameters()}
    out = {names[id(p)]: p.detach().cpu().numpy().copy() for p in self.norms}
    out["prompt_embeddings"] = self.net.prompt_embeddings.detach().cpu().numpy().copy()
    out["deep_prompt_embeddings"] = self.net.deep_prompt_embeddings.detach().cpu().numpy().copy()
    for k, v in self.net.predictors.state_dict().items():
      out[f"predictors.{k}"] = v.detach().cpu().numpy().copy()
    return out
