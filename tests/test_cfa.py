"""CFA: the head-input feature, the source statistics, the loss, the torch-style clipping, padding, and
agreement with the PyTorch reference written as the official code (benchmarks/torch_methods/cfa.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import split
from pcsr_jax.methods.cfa import clip_grad_norm_torch
from pcsr_jax.models import ViTConfig, create
from pcsr_jax.models.vit import features_and_logits
from tiny import TINY, batches, tiny_model

B = 8


def np_h(z):
  z = z.astype(np.float64)
  z = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)
  return np.tanh(z)


def labelled_source(sizes=(B, B, 5), seed=7, cfg=TINY, classes=None):
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(sizes):
    x = rng.standard_normal((n, cfg.img_size, cfg.img_size, 3)).astype(np.float32)
    y = (np.arange(n) + i * 3) % cfg.num_classes if classes is None else rng.choice(classes, n)
    out.append((x, y.astype(np.int32)))
  return out


def stats_for(method, model, params, source):
  prep = method.prepare(model, params, jax.random.key(0), B)
  frozen, trainable = split(prep.params, prep.is_trainable)
  return method.compute_source_stats(prep, frozen, trainable, iter(source))


def test_prelogits_are_the_head_input_and_default_output_is_unchanged():
  model, params = tiny_model()
  x = batches(1, 4)[0]
  z, logits = features_and_logits(model, params, x)
  np.testing.assert_allclose(model.apply({"params": params}, x), logits, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(z @ params["head"]["kernel"] + params["head"]["bias"], logits, rtol=1e-5, atol=1e-5)
  assert z.shape == (4, TINY.embed_dim)


def test_source_statistics_match_two_pass_numpy():
  model, params = tiny_model()
  source = labelled_source()
  stats = stats_for(methods.get("cfa"), model, params, source)
  h = np.concatenate([np_h(np.asarray(features_and_logits(model, params, x)[0]))
                      for x, _ in source])
  y = np.concatenate([y for _, y in source])
  mu = h.mean(0)
  np.testing.assert_allclose(stats["mean"], mu, rtol=1e-5, atol=1e-6)
  for k in range(2, 6):
    np.testing.assert_allclose(stats[f"moment_{k}"], ((h - mu) ** k).mean(0), rtol=1e-4, atol=1e-6)
  for c in range(TINY.num_classes):
    assert stats["class_count"][c] == (y == c).sum() > 0
    np.testing.assert_allclose(stats["class_mean"][c], h[y == c].mean(0), rtol=1e-5, atol=1e-6)
  with pytest.raises(UserError, match="source label"):
    stats_for(methods.get("cfa"), model, params, [(source[0][0], -np.ones(B, np.int32))])


def np_cfa_loss(logits, z, stats, moments=3):
  h = np_h(z)
  mu = h.mean(0)
  loss = np.linalg.norm(mu - stats["mean"]) / 2
  for k in range(2, moments + 1):
    loss += np.linalg.norm(((h - mu) ** k).mean(0) - stats[f"moment_{k}"]) / 2 ** k
  yhat = logits.argmax(-1)
  present = [c for c in np.unique(yhat) if stats["class_count"][c] > 0]
  cls = [np.linalg.norm(h[yhat == c].mean(0) - stats["class_mean"][c]) / 2 for c in present]
  return loss + np.mean(cls), len(present)


def test_loss_matches_numpy_and_classes_without_source_images_are_left_out():
  model, params = tiny_model()
  x = batches(1, B, seed=3)[0]
  z, logits = (np.asarray(a) for a in features_and_logits(model, params, x))
  yhat = set(logits.argmax(-1).tolist())
  assert len(yhat) >= 2
  missing = min(yhat)  # a predicted class the source set has no image of
  for source in (labelled_source(), labelled_source(classes=[c for c in range(10) if c != missing])):
    stats = stats_for(methods.get("cfa"), model, params, source)
    want, n_present = np_cfa_loss(logits, z, stats)
    ad = engine.Adapter(methods.get("cfa"), model, params, batch_size=B, source_stats=stats)
    state, out, metrics = ad.step(ad.init_state(), x)
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    assert int(metrics["num_classes"]) == n_present
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(state.trainable))
  assert stats["class_count"][missing] == 0 and n_present == len(yhat) - 1


def test_clipping_is_torchs_clip_grad_norm():
  g = {"a": jnp.asarray([3e-6, 4e-6]), "b": jnp.asarray([[12e-6]])}  # norm 1.3e-5: the + 1e-6 shows
  out, _ = clip_grad_norm_torch(1e-5).update(g, None)
  np.testing.assert_allclose(out["a"], np.array([3e-6, 4e-6]) * (1e-5 / (1.3e-5 + 1e-6)), rtol=1e-6)
  out, _ = clip_grad_norm_torch(1.35e-5).update(g, None)  # norm + 1e-6 above the max: still scaled (torch)
  np.testing.assert_allclose(out["b"], np.array([[12e-6]]) * (1.35e-5 / 1.4e-5), rtol=1e-6)
  out, _ = clip_grad_norm_torch(20.0).update(g, None)  # below the max: unchanged
  np.testing.assert_array_equal(out["b"], g["b"])
  with pytest.raises(UserError, match="max_grad_norm"):
    methods.get("cfa", max_grad_norm=0.0)
  with pytest.raises(UserError, match="full_max_moment"):
    methods.get("cfa", full_max_moment=6)


def test_padding_invariance_of_a_ragged_batch():
  model, params = tiny_model()
  stats = stats_for(methods.get("cfa"), model, params, labelled_source())
  xs = [x[:5] for x in batches(3, B, seed=3)]
  states = []
  for bs in (B, 5):
    ad = engine.Adapter(methods.get("cfa", lr=0.05), model, params, batch_size=bs, source_stats=stats)
    state = ad.init_state()
    for x in xs:
      state, _, metrics = ad.step(state, x)
    states.append(jax.tree.map(np.asarray, state.trainable))
  src = traverse_util.flatten_dict(params)
  assert any(np.abs(v - src[k]).max() > 1e-3 for k, v in traverse_util.flatten_dict(states[0]).items())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *states)


def test_cfa_requires_source_statistics():
  model, params = tiny_model()
  with pytest.raises(UserError, match="source"):
    engine.Adapter(methods.get("cfa"), model, params, batch_size=B)


# --- agreement with the PyTorch reference -----------------------------------------------------------------

CFG = ViTConfig(embed_dim=48, depth=12, num_heads=3, patch_size=8, img_size=32, num_classes=10)
STEPS = 6
MAX_NORM = 2.0  # this stream's pre-clip gradient norms straddle it: clipping acts on some steps, not all


@pytest.mark.torch
def test_cfa_agrees_with_pytorch():
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(CFG)
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((B, 32, 32, 3)).astype(np.float32) for _ in range(STEPS)]
  source = labelled_source(sizes=(B, B, B, 6), seed=1, cfg=CFG)
  params = weights.timm_to_flax(sd, CFG)
  method = methods.get("cfa", lr=0.01, max_grad_norm=MAX_NORM)
  stats = stats_for(method, create(CFG), params, source)
  ad = engine.Adapter(method, create(CFG), params, batch_size=B, source_stats=stats)
  nchw = lambda x: torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  ref = make_reference("cfa", timm_parity.timm_model(CFG, sd), B, lr=0.01, max_grad_norm=MAX_NORM,
                       source_batches=[(nchw(x), torch.from_numpy(y).long()) for x, y in source])
  for k, v in (("mean", ref.statistics["cmd_base_mid"][0]), ("moment_2", ref.statistics["cmd_base_mid"][1]),
               ("moment_3", ref.statistics["cmd_base_mid"][2]),
               ("class_mean", ref.statistics["cmd_base_mid_cls"][0])):
    np.testing.assert_allclose(stats[k], v.numpy().reshape(stats[k].shape), rtol=1e-4, atol=1e-6)
  state, norms = ad.init_state(), []
  for x in xs:
    state, logits, metrics = ad.step(state, x)
    t_logits = ref.step(nchw(x)).numpy()
    float_checks.assert_predictions_match(t_logits.argmax(-1), np.asarray(logits))
    np.testing.assert_allclose(np.asarray(logits), t_logits, atol=1e-4, rtol=1e-4)
    norms.append((float(metrics["grad_norm"]), ref.grad_norm, int(metrics["num_classes"])))
  print("cfa: pre-clip gradient norm (jax, torch) and pseudo-classes per step",
        [(round(a, 4), round(b, 4), c) for a, b, c in norms])
  np.testing.assert_allclose([a for a, _, _ in norms], [b for _, b, _ in norms], rtol=1e-4)
  assert any(a > MAX_NORM * 1.01 for a, _, _ in norms) and any(a < MAX_NORM * 0.99 for a, _, _ in norms)
  assert min(abs(a - MAX_NORM) for a, _, _ in norms) > 1e-3  # no clipping decided by float noise
  ts = ref.adapted_state()
  timm_jax, timm_src = weights.flax_to_timm(ad.params(state)), weights.flax_to_timm(ad.prep.params)
  assert len(ts) == 2 * (2 * CFG.depth + 1)  # every LayerNorm, the final norm included
  js, src = {k: timm_jax[k] for k in ts}, {k: timm_src[k] for k in ts}
  worst, worst_update, excess = float_checks.compare_updates(js, src, ts)
  print(f"cfa: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4 and excess <= 0, (worst, excess)
