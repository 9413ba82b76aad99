"""DePT-G's PyTorch reference (benchmarks/torch_methods/dept_g.py, written from ``yhygao/DePT``): what it
computes by itself, and agreement of `pcsr_jax.methods.dept` with it on the same weights, prompts, heads and
views."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.torch

# 4 blocks in 4 stages (the scripts' stage count, so the stage weights are softmax(1..4)); small DINO heads.
HEADS = dict(out_dim=32, hidden_dim=16, bottleneck_dim=8)


def tiny_cfg():
  from pcsr_jax.models import ViTConfig

  return ViTConfig(embed_dim=24, depth=4, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


def test_weight_norm_linear_is_torchs_weight_norm():
  """The written-out last layer computes what ``nn.utils.weight_norm`` (the official's) computes."""
  import torch

  from benchmarks.torch_methods.dept_g import WeightNormLinear

  torch.manual_seed(0)
  ours = WeightNormLinear(8, 5)
  with torch.no_grad():
    ours.weight_g.copy_(torch.rand(5, 1) + 0.5)  # a gain other than 1, so that a misplaced one would show
  lin = torch.nn.Linear(8, 5, bias=False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    official = torch.nn.utils.weight_norm(lin)
  with torch.no_grad():
    official.weight_g.copy_(ours.weight_g)
    official.weight_v.copy_(ours.weight_v)
  x = torch.randn(3, 8)
  np.testing.assert_allclose(ours(x).detach().numpy(), official(x).detach().numpy(), rtol=1e-6, atol=1e-7)
  assert [n for n, _ in ours.named_parameters()] == ["weight_g", "weight_v"]


def test_dino_loss_stage_weights_and_prompt_diversity():
  """softmax(1..4) stage weights; the prompt diversity is minus the mean off-diagonal cosine distance over the
  full P x P matrix (diagonal counted as 0)."""
  import torch

  from benchmarks.torch_methods.dept_g import DINOLoss

  loss = DINOLoss(6, 4)
  np.testing.assert_allclose(loss.weight_list, np.exp([1, 2, 3, 4]) / np.exp([1, 2, 3, 4]).sum())
  p = np.random.default_rng(0).standard_normal((2, 3, 6))
  n = p / np.linalg.norm(p, axis=-1, keepdims=True)
  dist = 1 - n @ n.transpose(0, 2, 1)
  want = -(dist * (1 - np.eye(3))).mean()
  np.testing.assert_allclose(float(DINOLoss.prompt_diversity_loss(torch.tensor(p, dtype=torch.float32))), want,
                             rtol=1e-5)


def test_reference_online_stream_ema_bank_and_knn():
  """On its own: the teacher is the EMA of the student taken before each update, the ring wraps, the
  pseudo-labels switch from argmax to kNN once the bank holds ``warmup`` entries, clipping acts."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  cfg = tiny_cfg()
  model, _ = timm_parity.random_model(cfg)
  torch.manual_seed(0)
  rng = np.random.default_rng(0)
  b, steps = 4, 5
  views = [tuple(torch.from_numpy(rng.standard_normal((b, 3, 32, 32)).astype(np.float32)) for _ in range(3))
           for _ in range(steps)]
  ref = make_reference("dept-g", model, b, stage_num=4, prompt_num=2, queue_size=10, warmup=8, num_neighbors=3,
                       view_source=iter(views), **HEADS)
  s0 = ref.adapted_state()
  knn, clipped = [], []
  for i in range(steps):
    before = ref.adapted_state()
    teacher_before = ref.teacher_state()
    ref.step(torch.zeros(b, 3, 32, 32))
    knn.append(ref.knn_steps)
    clipped.append(sum(n > 1.0 for n in ref.last_grad_norms))
    for (k, t), t0 in zip(ref.teacher_state().items(), teacher_before.values()):  # EMA before the update
      np.testing.assert_allclose(t, 0.99 * t0 + 0.01 * before[k.replace("teacher", "student", 1)], rtol=1e-5,
                                 atol=1e-7)
  assert knn == [0, 0, 1, 2, 3]  # bank 4, 8 (= warmup) -> kNN from the third step
  assert ref.banks["wraps"] == 2 and ref.banks["filled"] == 10 and ref.banks["ptr"] == 0
  assert all(c > 0 for c in clipped)
  assert all(np.abs(ref.adapted_state()[k] - s0[k]).max() > 0 for k in s0)
