"""DePT-G in PyTorch, written from its authors' code (``yhygao/DePT``, one commit, built on AdaContrast's).

From the official files:

* `PromptedViT` is ``classifier.py``'s ``ViT_DePT`` over a given timm ViT: the blocks split into ``stage_num``
  equal groups, one ``[1, prompt_num, D]`` prompt per group (xavier-uniform), prepended before the class token
  (the prompts get no position embedding); at each boundary the previous stage's prompt outputs are cut off and
  kept, the next stage's prompts prepended; the last stage's prompt outputs are taken after the final norm, the
  intermediate ones before it (as the official); the feature is the token at index ``prompt_num``.
* `DINOHead` and `DePTDino` are ``model/dept_dino.py``'s: one head per stage (``hierarchy=True``; 2 layers,
  hidden 2048, bottleneck 256, ``out_dim`` 2048, truncated-normal init, a weight-normalised last layer with its
  gain frozen at 1), the teacher's prompted ViT and heads updated by EMA over every parameter (the frozen
  backbone's too, as ``_momentum_update_teacher``) at every non-``cls_only`` forward, the teacher seeing the
  first strong view and the student the second, the CLS output through the last stage's head.
* `DINOLoss` is ``losses.py``'s: CE between the student's output / 0.1 and the softmax of the centred teacher
  output / the teacher temperature (its schedule by epoch), the centre updated with momentum 0.9 after the loss;
  per stage (weights softmax(1..S)) the cosine consistency of the prompts' head outputs and the prompt diversity
  (minus the mean off-diagonal cosine distance between one image's prompt outputs, the diagonal counted as 0).
* `Reference.step` is ``target_dino.py``'s ``train_epoch`` body: the student's weak-view feature and logits,
  pseudo-labels from the 10 nearest bank features by cosine (``distances.sort()``), averaging the bank's
  probabilities, the ``DePTDino`` forward on the two strong views, CE + 0.1 DINO-CLS + 0.1 prompt consistency +
  1.0 diversity (``div``) + 0.05 prompt diversity (the VisDA-C script's weights), per-tensor clipping of the
  student's gradients at 1.0 (``clip_gradients(model.student, ...)``: each stage's prompt tensor on its own, the
  DINO heads' not at all), SGD
  Nesterov (momentum 0.9, wd 1e-4, lr 5e-3) over the prompts, the classifier head and the student heads
  (``get_prompt_params``), then the teacher's weak-view outputs written into the bank.
* `source_loss` is ``source.py``'s ``train_epoch`` loss on one batch: the EMA, the DePTDino forward on the two
  strong views, label-smoothed CE (0.1) + 0.1 DINO-CLS + 0.1 prompt consistency + 0.005 prompt diversity, the
  teacher temperature 0.04 -> 0.07 over 3 of 5 epochs (the ImageNet script); `source_optimizer` is its
  optimizer (no gradient clipping in the source stage); the teacher there is a second model with its own
  random prompts and heads (`build`'s ``teacher_state``).

Departures (the code is incomplete or offline; the online choices are `pcsr_jax.methods.dept`'s):

* The weight-normalised last layer is written out (`WeightNormLinear`: ``weight_g``, ``weight_v`` and the same
  ``torch._weight_norm`` kernel as ``nn.utils.weight_norm``, which torch 2 deprecates and which cannot be deep
  copied).
* The DINO centre is updated with the batch mean: the official divides the batch sum by the batch size only
  under DDP (both scripts run distributed, so that is what they compute).
* The classifier head is the given model's (the official builds a new Linear for a non-1000-class set and
  trains it in the source stage).
* Online, as the official has no online entry point (``train_target_dino_online`` is undefined) and fills its
  bank with the whole target set before training, the choices of `pcsr_jax.methods.dept`: the bank is a FIFO
  ring of ``queue_size`` (16,384) entries filled from the stream with the teacher's weak-view outputs; until it
  holds ``warmup`` (1,024) entries, and at least ``num_neighbors``, the pseudo-labels are the argmax of the
  student's weak-view probabilities (AdaContrast's online form), then kNN over the filled entries; one
  iteration per batch (``steps``; the config's ``iters_per_batch`` is read by nothing), each with its own views
  and bank write; the prediction is the student's on the unaugmented batch after the update; the head and the
  DINO heads adapt; the VisDA-C script's loss weights; a constant learning rate (the official's cosine runs over
  a known number of epochs); the teacher temperature 0.07 from the first step (the target script's). The
  student's weak-view forward runs without a graph (the official keeps one it never uses).
* Views come from ``view_source`` when given (an iterator of ``(weak, strong_teacher, strong_student)``
  normalised NCHW tensors, one per iteration), else they are drawn with torchvision as ``DataAugmentationDINO``
  at the input size (weak: resize to size * 256 / 224, random crop, flip; strong: random resized crop (0.2, 1)
  bicubic, flip, colour jitter p 0.8, greyscale p 0.2, blur p 0.5 (``global_transfo``)).
"""

from __future__ import annotations

import copy
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class PromptedViT(nn.Module):
  """``ViT_DePT`` (``stage_num`` > 0) over the modules of a timm ``VisionTransformer``."""

  def __init__(self, vit: nn.Module, stage_num: int = 4, prompt_num: int = 50):
    super().__init__()
    depth = len(vit.blocks)
    if stage_num not in (1, 2, 3, 4, 6, 12) or depth % stage_num:
      raise ValueError(f"stage_num {stage_num} must be one of 1, 2, 3, 4, 6, 12 and divide the depth {depth}")
    self.stage_num, self.prompt_num = stage_num, prompt_num
    self.patch_embed, self.cls_token, self.pos_embed, self.pos_drop = (vit.patch_embed, vit.cls_token,
                                                                       vit.pos_embed, vit.pos_drop)
    self.norm, self.head = vit.norm, vit.head
    self.output_dim = vit.head.in_features
    per = depth // stage_num
    dim = self.cls_token.shape[-1]
    self.prompt_list = nn.ParameterList(
        [nn.Parameter(nn.init.xavier_uniform_(torch.zeros(1, prompt_num, dim))) for _ in range(stage_num)])
    self.encoder_list = nn.ModuleList(
        [nn.Sequential(*vit.blocks[i * per:(i + 1) * per]) for i in range(stage_num)])

  def forward(self, x: torch.Tensor, return_feats: bool = False):
    x = self.patch_embed(x)
    n = x.shape[0]
    x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1)
    x = self.pos_drop(x + self.pos_embed)
    x = torch.cat([self.prompt_list[0].expand(n, -1, -1), x], dim=1)
    x = self.encoder_list[0](x)
    prompts = []
    for i in range(1, self.stage_num):
      prompts.append(x[:, :self.prompt_num])
      x = torch.cat([self.prompt_list[i].expand(n, -1, -1), x[:, self.prompt_num:]], dim=1)
      x = self.encoder_list[i](x)
    x = self.norm(x)
    prompts.append(x[:, :self.prompt_num])
    feat = x[:, self.prompt_num]
    logits = self.head(feat)
    return (feat, logits, prompts) if return_feats else logits

  def prompt_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``get_prompt_params``: freezes the backbone; (prompts, head params)."""
    self.requires_grad_(False)
    self.prompt_list.requires_grad_(True)
    self.head.requires_grad_(True)
    return list(self.prompt_list), list(self.head.parameters())


class WeightNormLinear(nn.Module):
  """``nn.utils.weight_norm(nn.Linear(in, out, bias=False))`` (dim 0): ``weight_g`` [out, 1], ``weight_v``."""

  def __init__(self, in_dim: int, out_dim: int):
    super().__init__()
    v = nn.Linear(in_dim, out_dim, bias=False).weight.detach().clone()
    self.weight_g = nn.Parameter(torch.ones(out_dim, 1))  # DINOHead: weight_g.data.fill_(1)
    self.weight_v = nn.Parameter(v)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, torch._weight_norm(self.weight_v, self.weight_g, 0))


class DINOHead(nn.Module):
  """``model/dept_dino.py``'s ``DINOHead`` (``use_bn=False``, ``nlayers`` >= 2, ``norm_last_layer=True``)."""

  def __init__(self, in_dim: int, out_dim: int, nlayers: int = 2, hidden_dim: int = 2048,
               bottleneck_dim: int = 256):
    super().__init__()
    if nlayers < 2:
      raise ValueError(f"nlayers {nlayers}: the scripts use 2")
    layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
    for _ in range(nlayers - 2):
      layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
    layers.append(nn.Linear(hidden_dim, bottleneck_dim))
    self.mlp = nn.Sequential(*layers)
    for m in self.mlp:
      if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02, a=-2.0, b=2.0)
        nn.init.zeros_(m.bias)
    self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
    self.last_layer.weight_g.requires_grad = False

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class DePTDino(nn.Module):
  """``DePTDino`` with ``hierarchy=True`` and ``consistency_type='cls_prompt'``."""

  def __init__(self, student: PromptedViT, teacher: PromptedViT, m: float = 0.99, nlayer_head: int = 2,
               out_dim: int = 2048, hidden_dim: int = 2048, bottleneck_dim: int = 256):
    super().__init__()
    self.student, self.teacher, self.m, self.out_dim = student, teacher, m, out_dim
    head = lambda: DINOHead(student.output_dim, out_dim, nlayer_head, hidden_dim, bottleneck_dim)
    self.student_dinohead = nn.ModuleList([head() for _ in range(student.stage_num)])
    self.teacher_dinohead = nn.ModuleList([head() for _ in range(student.stage_num)])
    # target_dino.py: load_from_checkpoint(..., same_student_teacher=True)
    self.teacher.load_state_dict(self.student.state_dict())
    self.teacher_dinohead.load_state_dict(self.student_dinohead.state_dict())
    self.teacher.requires_grad_(False)
    self.teacher_dinohead.requires_grad_(False)

  @torch.no_grad()
  def momentum_update_teacher(self) -> None:
    for pq, pk in zip(self.student.parameters(), self.teacher.parameters()):
      pk.data = pk.data * self.m + pq.data * (1.0 - self.m)
    for pq, pk in zip(self.student_dinohead.parameters(), self.teacher_dinohead.parameters()):
      pk.data = pk.data * self.m + pq.data * (1.0 - self.m)

  def multi_crop_forward(self, x: torch.Tensor, mode: str = "student"):
    heads, model = ((self.student_dinohead, self.student) if mode == "student"
                    else (self.teacher_dinohead, self.teacher))
    feat, logits, prompts = model(x, return_feats=True)
    outs = []
    for head, p in zip(heads, prompts):
      b, pn, d = p.shape
      outs.append(head(p.reshape(b * pn, d)).reshape(b, pn, self.out_dim))
    return heads[-1](feat), logits, outs

  def forward(self, views: Sequence[torch.Tensor]):
    """``forward(im_q)`` without ``cls_only``: the EMA, then the teacher on ``views[0]``, the student on
    ``views[1]``."""
    self.momentum_update_teacher()
    with torch.no_grad():
      t_cls, _, t_prompt = self.multi_crop_forward(views[0], mode="teacher")
    s_cls, s_logits, s_prompt = self.multi_crop_forward(views[1], mode="student")
    return t_cls, s_cls, s_logits, t_prompt, s_prompt

  def prompt_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``get_prompt_params(fix_ss_head=False)``: (prompts, head + student DINO heads)."""
    prompts, extra = self.student.prompt_params()
    return prompts, extra + list(self.student_dinohead.parameters())


class DINOLoss(nn.Module):
  """``losses.py``'s ``DINOLoss`` (``layerwise_weight=True``, consistency ``cls_prompt``), the centre updated
  with the batch mean."""

  def __init__(self, out_dim: int, stage_num: int, teacher_temp: float = 0.07, student_temp: float = 0.1,
               center_momentum: float = 0.9, prompt_div: bool = True, teacher_init_temp: float = 0.07,
               warmup_epoch: int = 0, epochs: int = 1, tau: float = 1.0):
    super().__init__()
    self.student_temp, self.center_momentum, self.prompt_div = student_temp, center_momentum, prompt_div
    self.teacher_temp_schedule = np.concatenate((np.linspace(teacher_init_temp, teacher_temp, warmup_epoch),
                                                 np.ones(epochs - warmup_epoch) * teacher_temp))
    self.register_buffer("center", torch.zeros(1, out_dim))
    w = np.exp((np.arange(stage_num) + 1) / tau)
    self.weight_list = w / w.sum()

  @staticmethod
  def prompt_diversity_loss(prompt: torch.Tensor) -> torch.Tensor:
    x = F.normalize(prompt, dim=-1)
    dist = 1 - torch.bmm(x, x.permute(0, 2, 1))
    mask = torch.ones(dist.shape[-1]) - torch.eye(dist.shape[-1])
    return -(dist * mask.to(prompt.device).unsqueeze(0)).mean()

  def forward(self, s_cls, t_cls, s_prompt, t_prompt, epoch: int = 0):
    ttemp = self.teacher_temp_schedule[epoch]
    teacher = F.softmax((t_cls - self.center) / ttemp, dim=-1)
    cls_loss = torch.sum(-teacher * F.log_softmax(s_cls / self.student_temp, dim=-1), dim=-1).mean()
    with torch.no_grad():
      self.center = self.center * self.center_momentum + t_cls.mean(0, keepdim=True) * (1 - self.center_momentum)
    prompt_loss, div_loss = 0, 0
    for i, (s, t) in enumerate(zip(s_prompt, t_prompt)):
      weight = self.weight_list[i]
      if self.prompt_div:
        div_loss = div_loss + self.prompt_diversity_loss(s) * weight
      b, pn, dim = s.shape
      cos = 1 - (F.normalize(s.reshape(b * pn, dim), dim=-1) * F.normalize(t.reshape(b * pn, dim).detach(),
                                                                           dim=-1)).sum(-1)
      prompt_loss = prompt_loss + cos.mean() * weight
    return cls_loss, prompt_loss, div_loss


def div(logits: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
  p = F.softmax(logits, dim=1).mean(0)
  return -torch.sum(-p * torch.log(p + epsilon))


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, num_classes: int,
                           epsilon: float = 0.0) -> torch.Tensor:
  log_probs = F.log_softmax(logits, dim=1)
  with torch.no_grad():
    targets = torch.zeros_like(log_probs).scatter_(1, labels.unsqueeze(1), 1)
    targets = (1 - epsilon) * targets + epsilon / num_classes
  return (-targets * log_probs).sum(dim=1).mean()


def clip_gradients(model: nn.Module, clip: float) -> dict[str, float]:
  """``utils.clip_gradients``: each gradient tensor scaled to norm ``clip`` if above (per tensor: each stage's
  prompts, ``prompt_list.<i>``, on their own). Returns each tensor's norm before clipping by its name (the
  official returns the list of norms; the names tell the tests which tensors were clipped)."""
  norms = {}
  for name, p in model.named_parameters():
    if p.grad is not None:
      norm = p.grad.data.norm(2)
      norms[name] = norm.item()
      coef = clip / (norm + 1e-6)
      if coef < 1:
        p.grad.data.mul_(coef)
  return norms


def torch_state(trained: Mapping[str, object]) -> dict[str, np.ndarray]:
  """`pcsr_jax.methods.dept`'s params (``prompts``, ``dino_i``, and ``head`` if given) under ``DePTDino``'s
  student names, for `build`'s ``state`` (torch Linear weights are the transposed kernels; DINO heads of any
  ``nlayer_head``: ``fc<j>`` is ``mlp.<2j>``, the GELUs between them)."""
  t = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).T)
  out = {f"student.prompt_list.{i}": np.asarray(p)[None] for i, p in enumerate(trained["prompts"])}
  if "head" in trained:
    out["student.head.weight"], out["student.head.bias"] = t(trained["head"]["kernel"]), np.asarray(
        trained["head"]["bias"])
  for i in range(len(trained["prompts"])):
    d = trained[f"dino_{i}"]
    for fc in sorted(k for k in d if k.startswith("fc")):
      j = 2 * int(fc[2:])
      out[f"student_dinohead.{i}.mlp.{j}.weight"] = t(d[fc]["kernel"])
      out[f"student_dinohead.{i}.mlp.{j}.bias"] = np.asarray(d[fc]["bias"])
    out[f"student_dinohead.{i}.last_layer.weight_v"] = t(d["last_v"])
  return out


def build(model: nn.Module, stage_num: int = 4, prompt_num: int = 50, m: float = 0.99, out_dim: int = 2048,
          hidden_dim: int = 2048, bottleneck_dim: int = 256, nlayer_head: int = 2,
          state: Optional[Mapping[str, np.ndarray]] = None,
          teacher_state: Optional[Mapping[str, np.ndarray]] = None) -> DePTDino:
  """A `DePTDino` over a timm ViT (the teacher's backbone a deep copy), the student's prompts and heads from
  ``state`` (``DePTDino`` parameter names of the student side: ``student.prompt_list.i``, ``student.head.*``,
  ``student_dinohead.*``) when given. The teacher starts equal to the student (``target_dino.py`` loads both
  from the source checkpoint), or from ``teacher_state`` (``teacher.*``, ``teacher_dinohead.*``): in
  ``source.py`` the teacher is a second model with its own random prompts and heads."""
  student = PromptedViT(model, stage_num, prompt_num)
  teacher = PromptedViT(copy.deepcopy(model), stage_num, prompt_num)
  dino = DePTDino(student, teacher, m, nlayer_head, out_dim, hidden_dim, bottleneck_dim)
  dino = dino.to(next(model.parameters()).device)
  own = dict(dino.named_parameters())
  for given in (state, teacher_state):
    unknown = sorted(set(given or {}) - set(own))
    if unknown:
      raise KeyError(f"unknown DePT parameters {unknown[:4]}")
    with torch.no_grad():
      for k, v in (given or {}).items():
        own[k].copy_(torch.from_numpy(np.array(v, np.float32)).reshape(own[k].shape))
  if teacher_state is None:
    dino.teacher.load_state_dict(dino.student.state_dict())
    dino.teacher_dinohead.load_state_dict(dino.student_dinohead.state_dict())
  return dino


def source_loss(dino: DePTDino, loss_fn: DINOLoss, views: Sequence[torch.Tensor], labels: torch.Tensor,
                epoch: int = 0, epsilon: float = 0.1, alpha: float = 1.0, beta: float = 0.1, beta2: float = 0.1,
                lam: float = 0.005) -> dict[str, torch.Tensor]:
  """``source.py``'s loss on one batch (the EMA and the centre update included): ``views`` are the two strong
  views (teacher's, student's); returns the total and its terms."""
  t_cls, s_cls, s_logits, t_prompt, s_prompt = dino(views)
  ce = smoothed_cross_entropy(s_logits, labels, s_logits.shape[1], epsilon)
  dino_cls, dino_prompt, prompt_div = loss_fn(s_cls, t_cls, s_prompt, t_prompt, epoch=epoch)
  total = alpha * ce + beta * dino_cls + beta2 * dino_prompt + lam * prompt_div
  return dict(total=total, ce=ce, dino_cls=dino_cls, dino_prompt=dino_prompt, prompt_div=prompt_div)


def source_optimizer(dino: DePTDino, lr: float = 5e-4, finetune_backbone: bool = False, momentum: float = 0.9,
                     weight_decay: float = 1e-4) -> torch.optim.SGD:
  """``get_source_optimizer`` with ``tune_type='full'`` (the scripts'): SGD Nesterov, the backbone at ``lr``, the
  prompts, head and student DINO heads at 10 x ``lr``. Without ``finetune_backbone`` the backbone is frozen and
  its group empty (the prompts keep the 10x, as ``experiments/train_prompts.py``; the official
  ``tune_type='prompt'`` would give them 1x, and its scripts never run it)."""
  st = dino.student
  st.requires_grad_(finetune_backbone)
  st.prompt_list.requires_grad_(True)
  st.head.requires_grad_(True)
  extra = list(st.prompt_list) + list(st.head.parameters()) + [
      p for p in dino.student_dinohead.parameters() if p.requires_grad]
  ids = {id(p) for p in extra}
  backbone = [p for p in st.parameters() if p.requires_grad and id(p) not in ids]
  group = dict(momentum=momentum, weight_decay=weight_decay, nesterov=True)
  return torch.optim.SGD([dict(params=backbone, lr=lr, **group), dict(params=extra, lr=lr * 10, **group)])


def source_dino_loss(out_dim: int, stage_num: int, epochs: int = 5) -> DINOLoss:
  """The ImageNet source script's ``DINOLoss``: teacher temperature 0.04 -> 0.07 over 3 epochs, student 0.1."""
  return DINOLoss(out_dim, stage_num, teacher_temp=0.07, student_temp=0.1, prompt_div=True,
                  teacher_init_temp=0.04, warmup_epoch=3, epochs=epochs)


class Reference:
  """``step(x)``: ``steps`` DePT test-time iterations on the batch, then the student's prediction of ``x``."""

  def __init__(self, model: nn.Module, batch_size: int, stage_num: int = 4, prompt_num: int = 50,
               state: Optional[Mapping[str, np.ndarray]] = None, out_dim: int = 2048, hidden_dim: int = 2048,
               bottleneck_dim: int = 256, nlayer_head: int = 2, lr: float = 5e-3, momentum: float = 0.9,
               weight_decay: float = 1e-4, ema: float = 0.99, teacher_temp: float = 0.07,
               student_temp: float = 0.1, num_neighbors: int = 10, queue_size: int = 16384,
               warmup: int = 1024, alpha: float = 1.0, beta: float = 0.1, beta2: float = 0.1,
               eta: float = 1.0, lam: float = 0.05, clip_grad: float = 1.0, steps: int = 1,
               mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
               view_source: Optional[Iterator[tuple[torch.Tensor, ...]]] = None):
    self.dino = build(model, stage_num, prompt_num, ema, out_dim, hidden_dim, bottleneck_dim, nlayer_head, state)
    self.dino.train()
    self.loss_fn = DINOLoss(out_dim, stage_num, teacher_temp, student_temp, prompt_div=True,
                            teacher_init_temp=teacher_temp).to(self.dino.student.cls_token.device)
    prompts, extra = self.dino.prompt_params()
    group = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True)
    self.optimizer = torch.optim.SGD([dict(params=prompts, **group), dict(params=extra, **group)])
    self.weights = dict(alpha=alpha, beta=beta, beta2=beta2, eta=eta, lam=lam)
    self.clip_grad, self.steps = clip_grad, steps
    self.num_neighbors, self.queue_size = num_neighbors, queue_size
    self.warmup = warmup
    dev, dim = self.dino.student.cls_token.device, self.dino.student.output_dim
    classes = self.dino.student.head.out_features
    self.banks = {"features": torch.zeros(queue_size, dim, device=dev),
                  "probs": torch.zeros(queue_size, classes, device=dev), "ptr": 0, "filled": 0, "wraps": 0}
    self.mean, self.std, self.view_source = mean, std, view_source
    self.knn_steps, self.last_labels = 0, None

  def draw_views(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from torchvision import transforms as T

    size = x.shape[-1]
    mean = torch.tensor(self.mean, device=x.device)[:, None, None]
    std = torch.tensor(self.std, device=x.device)[:, None, None]
    weak = T.Compose([T.Resize([round(size * 256 / 224)] * 2, antialias=True), T.RandomCrop(size),
                      T.RandomHorizontalFlip()])
    strong = T.Compose([
        T.RandomResizedCrop(size, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC, antialias=True),
        T.RandomHorizontalFlip(p=0.5), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2), T.RandomApply([T.GaussianBlur(2 * (size // 20) + 1, sigma=(0.1, 2.0))], p=0.5)])
    view = lambda t: torch.stack([(t((img * std + mean).clamp(0, 1)) - mean) / std for img in x])
    return view(weak), view(strong), view(strong)

  @torch.no_grad()
  def pseudo_labels(self, feats_w: torch.Tensor, probs_w: torch.Tensor) -> torch.Tensor:
    """``refine_predictions`` over the filled bank once it holds ``warmup`` entries (and at least
    ``num_neighbors``), else the argmax."""
    filled = self.banks["filled"]
    self.last_argmax = probs_w.argmax(1)
    if filled < max(self.warmup, self.num_neighbors):
      return self.last_argmax
    self.knn_steps += 1
    bank = self.banks["features"][:filled]
    d = 1 - F.normalize(feats_w, dim=1) @ F.normalize(bank, dim=1).T
    idx = d.sort()[1][:, :self.num_neighbors]
    return self.banks["probs"][:filled][idx].mean(1).argmax(1)

  @torch.no_grad()
  def update_bank(self, feats: torch.Tensor, logits: torch.Tensor) -> None:
    """``update_labels`` on a FIFO ring: rows written at the pointer, modulo the size. The bank stays float32
    under bf16 autocast (as the JAX side's)."""
    n, k = len(feats), self.queue_size
    idx = torch.arange(self.banks["ptr"], self.banks["ptr"] + n, device=feats.device) % k
    self.banks["features"][idx] = feats.float()
    self.banks["probs"][idx] = F.softmax(logits.float(), dim=1)
    self.banks["wraps"] += (self.banks["ptr"] + n) // k
    self.banks["ptr"] = (self.banks["ptr"] + n) % k
    self.banks["filled"] = min(self.banks["filled"] + n, k)

  def iteration(self, x: torch.Tensor) -> dict[str, float]:
    weak, strong_t, strong_s = next(self.view_source) if self.view_source is not None else self.draw_views(x)
    dino = self.dino
    with torch.no_grad():
      feats_w, logits_w, _ = dino.student(weak, return_feats=True)
      labels = self.pseudo_labels(feats_w, F.softmax(logits_w, dim=1))
    t_cls, s_cls, s_logits, t_prompt, s_prompt = dino((strong_t, strong_s))
    loss_cls = F.cross_entropy(s_logits, labels)
    dino_cls, dino_prompt, prompt_div = self.loss_fn(s_cls, t_cls, s_prompt, t_prompt, epoch=0)
    loss_div = div(s_logits)
    w = self.weights
    loss = (w["alpha"] * loss_cls + w["beta"] * dino_cls + w["beta2"] * dino_prompt + w["eta"] * loss_div
            + w["lam"] * prompt_div)
    self.optimizer.zero_grad()
    loss.backward()
    self.last_grad_norms = clip_gradients(dino.student, self.clip_grad) if self.clip_grad else {}
    self.optimizer.step()
    with torch.no_grad():
      feats_t, logits_t, _ = dino.teacher(weak, return_feats=True)
    self.update_bank(feats_t, logits_t)
    self.last_labels = labels
    terms = dict(loss=loss, cls=loss_cls, dino_cls=dino_cls, dino_prompt=dino_prompt, div=loss_div,
                 prompt_div=prompt_div)
    return {k: float(v.detach()) for k, v in terms.items()}

  def step(self, x: torch.Tensor) -> torch.Tensor:
    for _ in range(self.steps):
      self.last_losses = self.iteration(x)
    with torch.no_grad():
      return self.dino.student(x)

  def adapted_state(self) -> dict[str, np.ndarray]:
    """The student's trainable params (``DePTDino`` names) as numpy."""
    return {k: v.detach().cpu().numpy().copy() for k, v in self.dino.named_parameters()
            if v.requires_grad}

  def teacher_state(self) -> dict[str, np.ndarray]:
    """The teacher's counterparts of `adapted_state` (``teacher.*``, ``teacher_dinohead.*``)."""
    own = dict(self.dino.named_parameters())
    names = [k.replace("student.", "teacher.", 1) if k.startswith("student.") else
             k.replace("student_dinohead.", "teacher_dinohead.", 1) for k in self.adapted_state()]
    return {k: own[k].detach().cpu().numpy().copy() for k in names}
