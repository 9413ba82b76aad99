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
    clipped.append(sum(n > 1.0 for n in ref.last_grad_norms.values()))
    for (k, t), t0 in zip(ref.teacher_state().items(), teacher_before.values()):  # EMA before the update
      np.testing.assert_allclose(t, 0.99 * t0 + 0.01 * before[k.replace("teacher", "student", 1)], rtol=1e-5,
                                 atol=1e-7)
  assert knn == [0, 0, 1, 2, 3]  # bank 4, 8 (= warmup) -> kNN from the third step
  assert ref.banks["wraps"] == 2 and ref.banks["filled"] == 10 and ref.banks["ptr"] == 0
  assert all(c > 0 for c in clipped)
  assert all(np.abs(ref.adapted_state()[k] - s0[k]).max() > 0 for k in s0)


def test_reference_runs_under_bf16_autocast_with_a_float32_bank():
  """The benchmarks time the reference under bf16 autocast (`step_throughput.torch_step`): the bank takes the
  bf16 features and probabilities as float32, as the JAX side keeps it."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  model, _ = timm_parity.random_model(tiny_cfg())
  ref = make_reference("dept-g", model, 2, stage_num=4, prompt_num=2, queue_size=4, warmup=2, num_neighbors=1,
                       **HEADS)
  x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
  for _ in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
      logits = ref.step(x)
  assert ref.banks["filled"] == 4 and ref.banks["features"].dtype == torch.float32
  assert torch.isfinite(logits.float()).all() and ref.banks["features"].abs().sum() > 0


def saved_prompts(directory, cfg, params, prompt, seed: int = 1):
  """Random prompts and DINO heads (`prompted.init_extra`) with the checkpoint's head, saved as
  ``train_prompts.py`` saves them; returns them."""
  import jax

  from pcsr_jax.methods.dept import save_prompts
  from pcsr_jax.models import create, prompted
  from pcsr_jax.checkpoint import params_digest

  extra = prompted.init_extra(prompted.create(create(cfg), prompt), jax.random.key(seed))
  trained = dict(jax.tree.map(np.asarray, extra), head=params["head"])
  save_prompts(str(directory), trained, prompt, {"checkpoint_sha256": params_digest(params)})
  return trained


@pytest.mark.slow
def test_dept_g_agrees_with_the_reference_on_a_stream_where_the_bank_wraps(tmp_path):
  """Same backbone, prompts, heads and views on both sides; bank of 10 with kNN labels (3 neighbours) from 8
  entries on, batches of 4 and a ragged last one: the ring wraps twice and the kNN labels take over from the
  argmax on the third batch. Identical predictions on every clearly decided sample, logits and every loss term
  within 1e-4, the same bank and DINO centre, and the student's and teacher's updates within the bound of
  `float_checks.compare_updates`.

  The gradient clip is 0.3 on both sides (the default 1.0 clips only the head on this tiny model, whose
  prompt gradients have norms of 0.05 to 0.6): so some stages' prompt gradients exceed it and others do not
  (counted from the reference's norms and asserted), where the official per-stage clipping of ``prompt_list[i]``
  and a clip of the stacked ``[S, P, D]`` prompts as one tensor give different updates."""
  import jax
  import torch

  import float_checks
  from benchmarks.torch_methods.dept_g import torch_state
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import engine, methods, timm_parity, weights
  from pcsr_jax.models import create, prompted

  cfg = tiny_cfg()
  _, sd = timm_parity.random_model(cfg, seed=2)  # seed 2: kNN relabels 5 of its 15 samples away from the argmax
  params = weights.timm_to_flax(sd, cfg)
  prompt = prompted.PromptConfig(stages=4, prompts=2, dino_layers=2, dino_hidden=HEADS["hidden_dim"],
                                 dino_bottleneck=HEADS["bottleneck_dim"], dino_out=HEADS["out_dim"])
  trained = saved_prompts(tmp_path, cfg, params, prompt)
  b, kq = 4, 10
  clip = 0.3
  hp = dict(queue_size=kq, warmup=8, num_neighbors=3, clip_grad=clip)
  method = methods.get("dept-g", prompts=str(tmp_path), **hp)
  ad = engine.Adapter(method, create(cfg), params, batch_size=b)
  state = ad.init_state()
  rng = np.random.default_rng(0)
  sizes = (b, b, b, b, b, 3)
  stream = [rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for n in sizes]
  views = [tuple(rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for _ in range(3)) for n in sizes]
  nchw = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))
  ref = make_reference("dept-g", timm_parity.timm_model(cfg, sd), b, stage_num=prompt.stages,
                       prompt_num=prompt.prompts, state=torch_state(trained),
                       view_source=iter([tuple(nchw(v) for v in vs) for vs in views]), **hp, **HEADS)
  src = torch_state(jax.tree.map(np.asarray, state.trainable))
  np.testing.assert_array_equal(src["student.prompt_list.3"], ref.adapted_state()["student.prompt_list.3"])

  @jax.jit
  def step(s, x, ok, vs):
    s, _, metrics = method.adapt(ad.prep, ad.frozen, s, x, ok, vs)
    return s, method.forward(ad.prep, ad.frozen, s.trainable, x)[0], metrics

  worst, knn, relabelled, clipped, stages_clipped, stages_kept = 0.0, [], 0, [], [], []
  terms = (("loss", "loss"), ("loss_cls", "cls"), ("loss_dino_cls", "dino_cls"), ("loss_prompt", "dino_prompt"),
           ("loss_div", "div"), ("loss_prompt_div", "prompt_div"))
  for x, vs in zip(stream, views):
    n = len(x)
    xp, ok = ad.pad(x)
    state, logits, metrics = step(state, xp, ok, tuple(ad.pad(v)[0] for v in vs))
    logits = np.asarray(logits)[:n]
    t_logits = ref.step(nchw(x)).numpy()
    float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
    np.testing.assert_allclose(logits, t_logits, atol=1e-4, rtol=1e-4)
    worst = max(worst, float(np.abs(logits - t_logits).max() / np.abs(t_logits).max()))
    for jk, tk in terms:
      np.testing.assert_allclose(float(metrics[jk]), ref.last_losses[tk], rtol=1e-4, atol=1e-6, err_msg=jk)
    knn.append(int(metrics["knn"]))
    relabelled += int((ref.last_labels != ref.last_argmax).sum()) if knn[-1] else 0
    clipped.append(sum(g > clip for g in ref.last_grad_norms.values()))
    stage_norms = [g for k, g in ref.last_grad_norms.items() if k.startswith("prompt_list.")]
    assert len(stage_norms) == prompt.stages
    stages_clipped.append(sum(g > clip for g in stage_norms))
    stages_kept.append(sum(g <= clip for g in stage_norms))
  ex = state.extra
  assert int(ex.bank_ptr) == ref.banks["ptr"] and int(ex.bank_filled) == ref.banks["filled"] == kq
  np.testing.assert_allclose(np.asarray(ex.bank_feats), ref.banks["features"].numpy(), atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(ex.bank_probs), ref.banks["probs"].numpy(), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ex.center), ref.loss_fn.center.numpy()[0], atol=1e-5, rtol=1e-4)
  rel, rel_update, excess = float_checks.compare_updates(
      torch_state(jax.tree.map(np.asarray, state.trainable)), src, ref.adapted_state())
  t_rel, t_rel_update, t_excess = float_checks.compare_updates(
      torch_state(jax.tree.map(np.asarray, ex.teacher)), src,
      {k.replace("teacher", "student", 1): v for k, v in ref.teacher_state().items()})
  knn_samples = sum(n for n, k in zip(sizes, knn) if k)
  print(f"dept-g: kNN per batch {knn} ({knn_samples} of {sum(sizes)} samples, {relabelled} relabelled away from "
        f"the argmax); bank wraps {ref.banks['wraps']}; tensors clipped per step {clipped}, of them prompt "
        f"stages {stages_clipped} (stages under the clip {stages_kept}); logits max rel diff "
        f"{worst:.2e}; student params {rel:.2e}, updates {rel_update:.2e}; teacher params {t_rel:.2e}, "
        f"updates {t_rel_update:.2e}")
  assert knn == [0, 0, 1, 1, 1, 1] and relabelled > 0 and ref.banks["wraps"] == 2
  assert all(0 < c for c in clipped)
  assert sum(stages_clipped) > 0 and any(c > 0 and k > 0 for c, k in zip(stages_clipped, stages_kept))
  assert excess <= 0 and t_excess <= 0, (excess, t_excess)


@pytest.mark.slow
def test_source_stage_loss_and_first_update_match_the_reference():
  """``experiments/train_prompts.py``'s first step (frozen backbone, no warm-up so that the step moves the
  params, epoch 1: teacher temperature 0.055) against ``source.py``'s loss on the same batch, views, student and
  (separately initialised) teacher: every loss term within 1e-5 relative, the DINO centre, the teacher's EMA and
  the student's SGD update within the bound of `float_checks.compare_updates`."""
  import jax
  import torch

  import float_checks
  from benchmarks.torch_methods import dept_g
  from benchmarks.torch_methods.dept_g import torch_state
  from pcsr_jax import augment, timm_parity, weights
  from pcsr_jax.experiments.train_prompts import Settings, Trainer
  from pcsr_jax.models import create, prompted

  cfg = tiny_cfg()
  _, sd = timm_parity.random_model(cfg, seed=2)
  params = weights.timm_to_flax(sd, cfg)
  prompt = prompted.PromptConfig(stages=4, prompts=2, dino_layers=2, dino_hidden=HEADS["hidden_dim"],
                                 dino_bottleneck=HEADS["bottleneck_dim"], dino_out=HEADS["out_dim"])
  lr, b, epoch, mean = 0.01, 6, 1, (0.5, 0.5, 0.5)
  tr = Trainer(create(cfg), params, prompt, finetune=False, lr=lr, warmup=0, total=10, seed=0, epochs=5,
               mean=mean, std=mean)
  s0 = tr.host_state()
  rng = np.random.default_rng(3)
  x = rng.standard_normal((b, 32, 32, 3)).astype(np.float32)
  labels = rng.integers(0, cfg.num_classes, b)
  # The trainer's views of step 0, drawn as it draws them (its keys), for the reference.
  k1, k2 = jax.random.split(jax.random.fold_in(tr.data_key, 0))
  x01 = augment.denormalize(x, mean, mean)
  views = [np.asarray(augment.normalize(augment.dept_strong(k, x01, Settings.crop_scale), mean, mean))
           for k in (k1, k2)]
  metrics = tr.step(x, labels.astype(np.int32), np.ones(b, bool), epoch)

  as_teacher = lambda st: {k.replace("student", "teacher", 1): v for k, v in st.items()}
  dino = dept_g.build(timm_parity.timm_model(cfg, sd), prompt.stages, prompt.prompts, **HEADS,
                      state=torch_state(s0["student"]), teacher_state=as_teacher(torch_state(s0["teacher"])))
  dino.train()
  loss_fn = dept_g.source_dino_loss(HEADS["out_dim"], prompt.stages, epochs=5)
  opt = dept_g.source_optimizer(dino, lr)
  nchw = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))
  out = dept_g.source_loss(dino, loss_fn, [nchw(v) for v in views], torch.from_numpy(labels), epoch=epoch)
  opt.zero_grad()
  out["total"].backward()
  opt.step()
  diffs = {}
  for jk, tk in (("loss", "total"), ("ce", "ce"), ("dino_cls", "dino_cls"), ("prompt", "dino_prompt"),
                 ("prompt_div", "prompt_div")):
    j, t = float(metrics[jk]), float(out[tk].detach())
    diffs[jk] = abs(j - t) / abs(t)
    np.testing.assert_allclose(j, t, rtol=1e-5, atol=1e-7, err_msg=jk)
  np.testing.assert_allclose(np.asarray(tr.state["center"]), loss_fn.center.numpy()[0], rtol=1e-5, atol=1e-7)
  trained = {k: v.detach().numpy() for k, v in dino.named_parameters() if v.requires_grad}
  rel, rel_update, excess = float_checks.compare_updates(torch_state(tr.student_params()),
                                                         torch_state(s0["student"]), trained)
  teacher = {k.replace("teacher", "student", 1): v.detach().numpy() for k, v in dino.named_parameters()
             if k.replace("teacher", "student", 1) in trained and k.startswith("teacher")}
  t_rel, _, t_excess = float_checks.compare_updates(torch_state(jax.device_get(tr.state["teacher"])),
                                                    torch_state(s0["teacher"]), teacher)
  print(f"dept-g source stage: loss terms {dict(zip(diffs, (f'{d:.1e}' for d in diffs.values())))} rel diff; "
        f"student params {rel:.2e}, updates {rel_update:.2e}; teacher params {t_rel:.2e}")
  assert excess <= 0 and t_excess <= 0, (excess, t_excess)
