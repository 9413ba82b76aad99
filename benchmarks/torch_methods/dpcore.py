"""DPCore in PyTorch, written from its official code (``zybeich/DPCore`` @ 79b143f, ``imagenet/``: ``dpcore.py``,
``vpt.py``, ``imagenetc.py``, ``conf.py``, ``cfgs/dpcore.yaml``, ``robustbench/data.py``, ``robustbench/utils.py``),
run as ``bash/dpcore.sh`` runs it. Citations below are ``file:line`` at that commit.

Prompted ViT (``vpt.py:10-100``), re-using the timm model's submodules:

* ``forward_features`` (``vpt.py:53-66``): ``patch_embed``, ``_pos_embed`` (CLS concatenated, then the position
  embedding added to CLS and patches, then ``pos_drop``), then the P prompts [1, P, D] inserted *after* CLS with
  *no* position embedding (``prompt_injection``, ``vpt.py:32-39``): [CLS, prompts, patches]; then ``norm_pre``,
  ``blocks``, the final ``norm``. No ``patch_drop`` (identity here). Logits: ``vit.forward_head`` (token pool,
  ``fc_norm``, ``head``) on those tokens (``dpcore.py:210``, ``vpt.py:68-71``).
* ``forward_raw_features`` (``vpt.py:88-100``): the same without the prompts, i.e. timm's ``forward_features``.
* The statistics are always of token 0, the CLS token *after* the final norm, ``features[:, 0]``.
* 8 prompts (``cfgs/dpcore.yaml:30``), init uniform +-sqrt(6 / (3 * 16 * 16 + 768)) ~ 0.0625 (``vpt.py:22-26``).

Source statistics (``DPCore.obtain_src_stat``, ``dpcore.py:90-120``; `source_statistics` here): ImageNet *train*
images, shuffled, through timm's eval transform of ``vit_base_patch16_224`` (normalized: mean = std = 0.5 for
the augreg2 weights), batches of 64 (``:95-99``). Per batch, the unprompted features (``:104``) and the
*prompted* logits with the initial prompts (``:106``); a sample is kept if its softmax entropy is
``< ln(1000)/2 - 1`` (``:107-108``, strict); the kept CLS features are collected until at least
``SRC_NUM_SAMPLES`` = 300 (``conf.py:144``) are, then cut to the first 300 (``:111-117``);
``train_info = torch.std_mean(features, dim=0)`` = (std, mean), std *unbiased* (Bessel, torch's default
correction 1) (``:119``). The ``ln(1000)`` is the class count of ImageNet: ``threshold`` defaults to
``ln(num_classes)/2 - 1`` here, the official value for 1000 classes.

Loss (``forward_and_get_loss`` ``:152-168``, ``forward_and_adapt`` ``:196-216``): per batch, ``std_B, mean_B =
std_mean(cls, dim=0)`` (unbiased), ``L = lamda * ||std_B - std_s||_2 + ||mean_B - mean_s||_2`` (plain L2 norms,
not squared), ``lamda`` = 1.0 (``:15``).

One batch (``DPCore.forward`` ``:67-88`` with ``_eval_coreset`` ``:41-65``, all under ``torch.no_grad`` from
``clean_accuracy``, ``robustbench/utils.py:210``; only ``forward_and_adapt`` enables grads, ``:195``):

1. ``L0``, ``mean_raw``, ``std_raw`` from the *unprompted* forward (``:45``).
2. If the coreset is non-empty (``:49-57``): ``d_j = ||mean_raw - mean_j|| + lamda * ||std_raw - std_j||``,
   ``w = softmax(-d / tau)`` over the elements (``calculate_weights`` ``:183-193``), the prompt
   ``p_w = sum_j w_j p_j`` (``:51``), ``L1`` = the loss of the prompted forward at ``p_w`` (``:53-56``).
   The batch is "known" iff ``L1 < thr_rho * L0`` (``:57``, strict). An empty coreset is never known (``:62-63``).
3. Known (``:69-74``): ``E_ID`` = 1 times (``:19``): the prompts set to ``p_w`` and a *fresh*
   ``AdamW([prompts], lr=0.1)`` (torch defaults: betas (0.9, 0.999), eps 1e-8, weight_decay 0.01), one
   ``forward_and_adapt``: prompted forward, loss, logits of *that* forward (before the step), backward, step
   (``:200-214``). Each repetition restarts from ``p_w`` with a new optimizer (``:71-72``), so only the last one
   counts. Then every element j moves (``_update_coreset`` ``:32-38``), with the batch stats of the *prompted*
   forward at ``p_w`` (the pre-step prompt; ``:73`` overwrites the raw ones) and the *post-step* prompt:
   ``mean_j += ema_alpha * w_j * (mean_B - mean_j)``, ``std_j += ema_alpha * w_j * clamp(std_B - std_j, min=0)``
   (std only grows, elementwise), ``p_j += ema_alpha * w_j * (p_new - p_j)``; ``w`` is step 2's.
4. New (``:76-86``): the prompts reset to their initial values (``load_model_and_optimizer`` ``:78-79``,
   ``:178-181``), a *fresh* ``AdamW([prompts], lr=0.1)`` (defaults as above, ``:81``), ``E_OOD`` =
   ``OPTIM.STEPS`` = 50 (``cfgs/dpcore.yaml:28``, ``imagenetc.py:178``) ``forward_and_adapt`` steps; the
   prediction is the logits of the 50th forward (prompt after 49 steps, ``:84``). Appended:
   ``[mean_raw, std_raw, prompt after the 50 steps]`` (``:86``), the stats being step 1's unprompted ones.

The prompts kept between batches (``prompts()``) are the last step's result; the next batch never uses them: it
starts from ``p_w`` or from the initial prompts. ``reset()`` (``:123-126``; called once, before the first
corruption, ``imagenetc.py:50-51``): initial prompts, empty coreset.

The optimizer built by ``setup_optimizer`` (``cfgs/dpcore.yaml``: AdamW, LR 0.01, BETA 0.9, WD 0.01;
``imagenetc.py:120-124,170-173``) only serves ``copy_model_and_optimizer``: every step uses a fresh
``AdamW(lr=1e-1)``, so the cfg LR is never used. ``lr`` and ``weight_decay`` here are those of the fresh optimizers
(0.1 and torch's default 0.01), in both branches.

Official inputs: the test images are Resize256 / CenterCrop224 / ToTensor, *not* normalized
(``robustbench/data.py:17-20,146-170``; the 'Standard' timm model is returned bare, ``robustbench/utils.py:114-117``),
while the source statistics come from normalized images (``dpcore.py:96-98``). This file takes ``images`` and
``x`` as given: the caller chooses what to pass.

Differences that do not change the values: the official wraps the model in ``model.train()``
(``dpcore.py:145``; ViT-B has no dropout or batch norm) and leaves the ViT's weights trainable (gradients are
computed but no optimizer holds them); here the model is frozen. It keeps the coreset's means/stds on the GPU
and its prompts on the CPU; here everything lives on the model's device. A batch of one sample gives NaN
(unbiased std), as in the official.

    stats = source_statistics(model, images, prompt_init, 64)
    ref = Reference(model, 64, stats["mean"], stats["std"], prompt_init)
    ref = Reference(model, 64, source_batches=[x0, x1, ...])   # the statistics from these (the benchmarks')
    logits = ref.step(x)   # ref.branches[-1] in {'known', 'new'}; ref.losses[-1] = (L0, L1 or None)
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from benchmarks.torch_reference import softmax_entropy


def _check_vit(vit: nn.Module) -> None:
  assert vit.cls_token is not None and getattr(vit, "num_reg_tokens", 0) == 0
  assert vit.global_pool == "token", vit.global_pool  # forward_head takes token 0, the CLS token
  assert not getattr(vit, "dynamic_img_size", False)


def _embed(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
  """timm's ``patch_embed`` + ``_pos_embed`` (``vpt.py:58-59``): [CLS, patches] with the position embedding."""
  h = vit.patch_embed(x)
  cls = vit.cls_token.expand(h.shape[0], -1, -1)
  if vit.no_embed_class:
    h = torch.cat((cls, h + vit.pos_embed), dim=1)
  else:  # ViT-B: CLS first, then the position embedding on CLS and patches
    h = torch.cat((cls, h), dim=1) + vit.pos_embed
  return vit.pos_drop(h)


def prompted_features(vit: nn.Module, x: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
  """Normed tokens of ``PromptViT.forward_features`` (``vpt.py:53-66``) for ``prompts`` [1, P, D], or of
  ``forward_raw_features`` (``vpt.py:88-100``) for None. Prompts go right after CLS, without position embedding."""
  h = _embed(vit, x)
  if prompts is not None:  # prompt_injection (vpt.py:32-39)
    h = torch.cat((h[:, :1], prompts.expand(h.shape[0], -1, -1), h[:, 1:]), dim=1)
  h = vit.norm_pre(h)
  h = vit.blocks(h)
  return vit.norm(h)


def _as_prompt(p, device: torch.device) -> torch.Tensor:
  t = torch.as_tensor(np.asarray(p, np.float32)).to(device)
  return t.reshape(1, -1, t.shape[-1]).clone()  # official layout [1, P, D] (vpt.py:23)


@torch.no_grad()
def source_statistics(model: nn.Module, images: torch.Tensor, prompts, batch_size: int,
                      threshold: float | None = None, num_samples: int = 300) -> dict:
  """``obtain_src_stat`` (``dpcore.py:90-120``) on ``images`` (in the given order; the official shuffles).

  ``threshold`` defaults to ``ln(num_classes)/2 - 1`` (the official ``math.log(1000)/2-1``, ``:108``); the filter
  uses the *prompted* logits with ``prompts`` (the initial ones) and the statistics the *unprompted* final-norm
  CLS features. Returns ``{'mean': [D], 'std': [D] (unbiased), 'kept': n}`` (n after the cut to ``num_samples``)."""
  _check_vit(model)
  if threshold is None:
    threshold = math.log(model.num_classes) / 2 - 1
  p = _as_prompt(prompts, model.cls_token.device)
  feats, num = [], 0
  for i in range(0, images.shape[0], batch_size):
    xb = images[i:i + batch_size]
    raw = prompted_features(model, xb, None)  # forward_raw_features (:104)
    logits = model.forward_head(prompted_features(model, xb, p))  # self.model(images), with prompts (:106)
    keep = torch.where(softmax_entropy(logits) < threshold)[0]  # :107-108
    feats.append(raw[keep][:, 0])  # :109-111
    num += int(keep.numel())
    if num >= num_samples:  # :113-114
      break
  f = torch.cat(feats, dim=0)[:num_samples]  # :116-117
  if f.shape[0] == 0:
    raise ValueError("no source image passes the entropy filter")
  std, mean = torch.std_mean(f, dim=0)  # :119, unbiased
  return {"mean": mean.cpu().numpy(), "std": std.cpu().numpy(), "kept": int(f.shape[0])}


class Reference:
  """DPCore on a timm ViT: a coreset of (mean, std, prompt) entries, a one-step "known" branch from the
  coreset-weighted prompt and a ``steps_new``-step "new" branch from the initial prompt."""

  def __init__(self, model: nn.Module, batch_size: int, source_mean=None, source_std=None, prompt_init=None,
               lr: float = 0.1, weight_decay: float = 0.01, steps_new: int = 50, steps_known: int = 1,
               thr_rho: float = 0.8, tau: float = 3.0, ema_alpha: float = 0.999, lamb: float = 1.0,
               source_batches=None, source_threshold: float | None = None, num_samples: int = 300,
               num_prompts: int = 8):
    _check_vit(model)
    assert steps_new >= 1 and steps_known >= 1
    if prompt_init is None:  # vpt.py:22-26's uniform init, drawn from a fixed torch seed
      bound = math.sqrt(6.0 / (3 * model.patch_embed.patch_size[0] ** 2 + model.embed_dim))
      gen = torch.Generator().manual_seed(0)
      prompt_init = (torch.rand(num_prompts, model.embed_dim, generator=gen) * 2 - 1).mul(bound).numpy()
    if source_batches is not None:  # the benchmarks' form: statistics from batches of source images
      images = torch.cat([b[0] if isinstance(b, (tuple, list)) else b for b in source_batches])
      stats = source_statistics(model, images, prompt_init, batch_size, source_threshold, num_samples)
      source_mean, source_std = stats["mean"], stats["std"]
    assert source_mean is not None and source_std is not None, "source statistics or source_batches"
    self.model = model
    self.batch_size = batch_size  # the stream's batch size (64, cfgs/dpcore.yaml:35); steps take x as given
    model.requires_grad_(False)
    dev = model.cls_token.device
    self.src_mean = torch.as_tensor(np.asarray(source_mean, np.float32)).to(dev)  # train_info[1]
    self.src_std = torch.as_tensor(np.asarray(source_std, np.float32)).to(dev)  # train_info[0]
    self.prompt_init = _as_prompt(prompt_init, dev)  # model_state's prompts (copy_model_and_optimizer, :26-27)
    self.lr, self.weight_decay = lr, weight_decay
    self.steps_new, self.steps_known = steps_new, steps_known  # E_OOD, E_ID (:19-20)
    self.thr_rho, self.tau, self.ema_alpha, self.lamb = thr_rho, tau, ema_alpha, lamb
    self.reset()

  def reset(self) -> None:
    """``DPCore.reset`` (``:123-126``): initial prompts, empty coreset."""
    self.prompt = nn.Parameter(self.prompt_init.clone())
    self._core: list[list[torch.Tensor]] = []  # [mean, std, prompt [1, P, D]] per element
    self.branches: list[str] = []
    self.losses: list[tuple[float, float | None]] = []

  def _stats_loss(self, x: torch.Tensor, prompts: torch.Tensor | None):
    """``forward_and_get_loss`` / the loss part of ``forward_and_adapt``: (loss, mean_B, std_B, normed tokens)."""
    feats = prompted_features(self.model, x, prompts)
    std, mean = torch.std_mean(feats[:, 0], dim=0)  # :160 / :202, unbiased
    loss = self.lamb * torch.norm(std - self.src_std, p=2) + torch.norm(mean - self.src_mean, p=2)  # :162-165
    return loss, mean, std, feats

  def _adapt(self, x: torch.Tensor, opt: torch.optim.Optimizer):
    """``forward_and_adapt`` (``:195-216``): logits of this forward, then one optimizer step on the prompts."""
    with torch.enable_grad():
      loss, mean, std, feats = self._stats_loss(x, self.prompt)
      out = self.model.forward_head(feats)  # :210
      loss.backward()  # :212-214
      opt.step()
      opt.zero_grad()
    return out.detach(), mean.detach(), std.detach()

  def _adamw(self) -> torch.optim.AdamW:
    # torch.optim.AdamW([prompts], lr=1e-1) (:72, :81): betas (0.9, 0.999), eps 1e-8, weight_decay 0.01 defaults
    return torch.optim.AdamW([self.prompt], lr=self.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=self.weight_decay)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # _eval_coreset (:41-65)
      l0, mean_raw, std_raw, _ = self._stats_loss(x, None)  # :45
      known, l1, w, p_w = False, None, None, None
      if self._core:  # :49-61
        means = torch.stack([e[0] for e in self._core])  # calculate_weights (:183-193)
        stds = torch.stack([e[1] for e in self._core])
        d = torch.norm(mean_raw - means, p=2, dim=1) + self.lamb * torch.norm(std_raw - stds, p=2, dim=1)
        w = torch.softmax(-d / self.tau, dim=0)
        p_w = torch.stack([w[j] * e[2] for j, e in enumerate(self._core)], dim=0).sum(dim=0)  # :51
        l1_t, _, _, _ = self._stats_loss(x, p_w)  # :53-56
        l1 = float(l1_t)
        known = bool(l1_t < l0 * self.thr_rho)  # :57
    if known:  # :69-74
      for _ in range(self.steps_known):
        self.prompt = nn.Parameter(p_w.clone())  # :71, each repetition restarts from p_w
        out, mean_b, std_b = self._adapt(x, self._adamw())  # :72-73
      with torch.no_grad():  # _update_coreset (:32-38): prompted stats at p_w, post-step prompt, step-2 weights
        p_new = self.prompt.detach().clone()
        a = self.ema_alpha
        for j, e in enumerate(self._core):
          e[0] += a * w[j] * (mean_b - e[0])
          e[1] += a * w[j] * torch.clamp(std_b - e[1], min=0.0)
          e[2] += a * w[j] * (p_new - e[2])
      self.branches.append("known")
    else:  # :76-86
      self.prompt = nn.Parameter(self.prompt_init.clone())  # load_model_and_optimizer (:78-79)
      opt = self._adamw()  # :81
      for _ in range(self.steps_new):  # :83-84
        out, _, _ = self._adapt(x, opt)
      self._core.append([mean_raw.clone(), std_raw.clone(), self.prompt.detach().clone()])  # :86, raw stats
      self.branches.append("new")
    self.losses.append((float(l0), l1))
    return out

  @property
  def coreset(self) -> list[dict[str, np.ndarray]]:
    """The coreset entries: ``mean`` [D], ``std`` [D], ``prompt`` [P, D]."""
    return [{"mean": e[0].cpu().numpy().copy(), "std": e[1].cpu().numpy().copy(),
             "prompt": e[2][0].cpu().numpy().copy()} for e in self._core]

  def prompts(self) -> np.ndarray:
    """The prompts [P, D] kept after the last step (the next step starts from p_w or the initial prompts)."""
    return self.prompt.detach()[0].cpu().numpy().copy()
