"""SPA: the predictor hook, gradient ascent on the noise strengths, the confidence-selected KL, padding,
and agreement with the PyTorch reference (benchmarks/torch_methods/spa.py) on the same views."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.augment import spa_patch_noise
from pcsr_jax.errors import UserError
from pcsr_jax.methods import spa
from pcsr_jax.methods.base import split
from pcsr_jax.models import ViTConfig, create
from tiny import TINY, batches, tiny_model

B = 8


@functools.lru_cache(maxsize=None)
def adapter(method: spa.SPA, batch_size: int = B) -> engine.Adapter:
  model, params = tiny_model()
  return engine.Adapter(method, model, params, batch_size=batch_size)


def jit_adapt(ad: engine.Adapter):
  return jax.jit(lambda frozen, state, x, valid, masked, key: ad.method.adapt(ad.prep, frozen, state, x, valid,
                                                                              masked, key))


def test_trainable_params_and_registry():
  m = methods.get("spa", noise_patch=8)
  ad = adapter(m)
  flat = traverse_util.flatten_dict(ad.init_state().trainable)
  norms = {k for k in flat if k[0] not in (spa.PREDICTOR, spa.NOISE)}
  assert norms == {(f"blocks_{i}", n, p) for i in range(TINY.depth) for n in ("norm1", "norm2")
                   for p in ("scale", "bias")} | {("norm", "scale"), ("norm", "bias")}
  np.testing.assert_array_equal(flat[(spa.PREDICTOR, "kernel")], np.eye(TINY.embed_dim))
  np.testing.assert_allclose(flat[(spa.NOISE, "alpha")], np.full((32 // 8) ** 2, np.sqrt(0.4)), rtol=1e-7)
  assert m.cost == "3F+1B"


def test_predictor_sits_between_the_final_norm_and_the_head():
  ad = adapter(spa.SPA(noise_patch=8))
  model, params = ad.prep.model, tiny_model()[1]
  x = batches(1, 4)[0]
  plain = np.asarray(model.apply({"params": params}, x))
  eye = jnp.eye(TINY.embed_dim)
  np.testing.assert_allclose(spa.apply_with_predictor(model, params, eye, x), plain, atol=1e-6)
  # A scaled predictor scales the head's input: logits - bias scale with it.
  bias = params["head"]["bias"]
  doubled = np.asarray(spa.apply_with_predictor(model, params, 2 * eye, x))
  np.testing.assert_allclose(doubled - bias, 2 * (plain - bias), rtol=1e-5, atol=1e-5)
  # And the step's plain forward (eval_order 'after') ignores the predictor and the strengths.
  frozen, trainable = split(ad.prep.params, ad.prep.is_trainable)
  trainable[spa.PREDICTOR] = {"kernel": 2 * eye}
  logits, _ = ad.method.forward(ad.prep, frozen, trainable, x)
  np.testing.assert_allclose(logits, plain, atol=1e-6)


def np_consistency(orig, aug, valid):
  def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  p, q = softmax(orig.astype(np.float64)), softmax(aug.astype(np.float64))
  sel = valid & (p.max(-1) > q.max(-1))
  kl = (p * (np.log(p) - np.log(q))).sum(-1)
  return (kl[sel].mean() if sel.any() else 0.0), sel


def test_consistency_loss_selects_and_averages_like_numpy():
  rng = np.random.default_rng(0)
  orig = rng.standard_normal((16, 10)).astype(np.float32) * 3
  aug = rng.standard_normal((16, 10)).astype(np.float32) * 3
  valid = np.arange(16) < 13
  loss, sel = spa.consistency_loss(orig, aug, valid)
  want, want_sel = np_consistency(orig, aug, valid)
  print(f"consistency: {want_sel.sum()} of {valid.sum()} valid rows selected")
  assert 0 < want_sel.sum() < valid.sum()
  np.testing.assert_array_equal(sel, want_sel)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  # Nothing selected (the augmented view more confident everywhere): zero loss and zero gradient.
  g = jax.grad(lambda a: spa.consistency_loss(orig * 0, a, valid)[0])(jnp.asarray(aug))
  assert float(spa.consistency_loss(orig * 0, aug, valid)[0]) == 0.0 and not np.any(np.asarray(g))
  # The original prediction is detached: no gradient reaches it.
  g_orig = jax.grad(lambda o: spa.consistency_loss(o, aug, valid)[0])(jnp.asarray(orig))
  assert not np.any(np.asarray(g_orig))


def test_renormalize_strengths():
  alpha = jnp.asarray([0.1, -0.3, 0.3, 0.2])
  out = np.asarray(spa.renormalize_strengths(alpha, 0.4))
  np.testing.assert_allclose(np.mean(out**2), 0.4, rtol=1e-6)
  np.testing.assert_allclose(out / np.asarray(alpha), out[0] / 0.1, rtol=1e-6)  # one common scale
  clipped = np.asarray(spa.renormalize_strengths(jnp.asarray([3.0, 0.1, 0.1, 0.1]), 0.4))
  assert clipped[0] == 1.0 and np.all(np.abs(clipped) <= 1.0)


def test_noise_strengths_take_a_gradient_ascent_step():
  m = spa.SPA(noise_patch=8, lr_noise=0.5)
  ad = adapter(m)
  state = ad.init_state()
  x = batches(1, B, seed=3)[0]
  valid = jnp.ones(B, bool)
  k_mask, k_noise = jax.random.split(jax.random.key(1))
  masked = m.masked_view(k_mask, jnp.asarray(x))
  alpha0 = np.asarray(state.trainable[spa.NOISE]["alpha"])

  def loss_of_alpha(alpha):
    trainable = dict(state.trainable, **{spa.NOISE: {"alpha": alpha}})
    return m.loss(ad.prep, ad.frozen, trainable, jnp.asarray(x), valid, masked, k_noise)[0]

  loss_and_grad = jax.jit(jax.value_and_grad(loss_of_alpha))
  loss0, g = loss_and_grad(jnp.asarray(alpha0))
  g = np.asarray(g)
  assert np.abs(g).max() > 1e-4
  new, _, _ = jit_adapt(ad)(ad.frozen, state, x, valid, masked, k_noise)
  got = np.asarray(new.trainable[spa.NOISE]["alpha"])
  # First step, empty momentum: alpha + lr * g (ascent), then the mean-alpha^2 rescale and clip.
  np.testing.assert_allclose(got, spa.renormalize_strengths(alpha0 + 0.5 * g, 0.4), rtol=1e-5, atol=1e-6)
  assert np.abs(got - np.asarray(spa.renormalize_strengths(alpha0 - 0.5 * g, 0.4))).max() > 1e-3
  # Ascent: a small step along the update direction (before the rescale) raises the loss, the other way lowers it.
  d = 1e-3 * g / np.linalg.norm(g)
  up, down = float(loss_and_grad(alpha0 + d)[0]), float(loss_and_grad(alpha0 - d)[0])
  assert down < float(loss0) < up, (down, float(loss0), up)


def test_padding_changes_nothing():
  m = spa.SPA(noise_patch=8)
  ad = adapter(m)
  step = jit_adapt(ad)
  x = batches(1, B, seed=5)[0]
  valid = np.arange(B) < 5
  k_mask, k_noise = jax.random.split(jax.random.key(2))
  masked = np.asarray(m.masked_view(k_mask, jnp.asarray(x)))
  outs = []
  for fill in (0.0, 7.0):
    xp, mp = x.copy(), masked.copy()
    xp[5:], mp[5:] = fill, -fill
    outs.append(step(ad.frozen, ad.init_state(), xp, valid, mp, k_noise))
  (s1, l1, m1), (s2, l2, m2) = outs
  for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s2.trainable)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.asarray(l1)[:5], np.asarray(l2)[:5])
  assert int(m1["num_selected_mask"]) <= 5 and int(m1["num_selected_noise"]) <= 5
  # The same as a 5-sample batch with no padding at all (another compiled shape: float noise only).
  ad5 = adapter(m, 5)
  s5, l5, _ = jit_adapt(ad5)(ad5.frozen, ad5.init_state(), x[:5], np.ones(5, bool), masked[:5], k_noise)
  for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s5.trainable)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(l1)[:5], l5, rtol=1e-5, atol=1e-5)


def test_a_run_is_reproducible_and_moves_everything():
  m = spa.SPA(noise_patch=8)
  ad = adapter(m)
  runs = []
  for _ in range(2):
    state = ad.init_state()
    for x in batches(3, B, seed=7, last=6):
      state, logits, metrics = ad.step(state, x)
      assert bool(metrics["finite"])
    runs.append(state)
  for a, b in zip(jax.tree.leaves(runs[0].trainable), jax.tree.leaves(runs[1].trainable)):
    np.testing.assert_array_equal(a, b)
  init = traverse_util.flatten_dict(ad.init_state().trainable)
  for k, v in traverse_util.flatten_dict(runs[0].trainable).items():
    assert np.abs(np.asarray(v) - np.asarray(init[k])).max() > 0, k


@pytest.mark.parametrize("kw", [dict(noise_ratio=0.0), dict(lr_norm=-1.0), dict(freq_mask_ratio=1.0),
                                dict(mean=(0.5, 0.5), std=(0.5, 0.5, 0.5)), dict(std=(0.5, 0.0, 0.5))])
def test_bad_hyperparameters(kw):
  with pytest.raises(UserError, match="spa"):
    methods.get("spa", **kw)


def test_noise_patch_must_divide_the_image():
  model, params = tiny_model()
  with pytest.raises(UserError, match="noise_patch"):
    engine.Adapter(spa.SPA(noise_patch=12), model, params, batch_size=B)


# --- agreement with the PyTorch reference -------------------------------------------------------------------

CFG = ViTConfig(embed_dim=48, depth=4, num_heads=3, patch_size=8, img_size=32, num_classes=10)
STEPS = 6


@pytest.mark.torch
def test_jax_and_pytorch_agree_with_the_same_views():
  import torch

  from benchmarks.torch_methods.spa import Reference
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(CFG)
  m = spa.SPA(noise_patch=8)
  ad = engine.Adapter(m, create(CFG), weights.timm_to_flax(sd, CFG), batch_size=B)
  step = jit_adapt(ad)
  rng = np.random.default_rng(0)
  xs = [np.clip(rng.standard_normal((B, 32, 32, 3)), -1, 1).astype(np.float32) for _ in range(STEPS)]
  n_strengths = (32 // 8) ** 2
  views, keys = [], []
  for i, x in enumerate(xs):
    k_mask, k_noise = jax.random.split(jax.random.key(100 + i))
    masked = np.asarray(m.masked_view(k_mask, jnp.asarray(x)))
    # The noise draw itself: strengths 1 on a zero image, no clip.
    noise = np.asarray(spa_patch_noise(k_noise, jnp.zeros((1, 32, 32, 3)), jnp.ones(n_strengths), 8,
                                       (-np.inf, np.inf)))[0]
    views.append((torch.from_numpy(np.ascontiguousarray(masked.transpose(0, 3, 1, 2))),
                  torch.from_numpy(np.ascontiguousarray(noise.transpose(2, 0, 1)))))
    keys.append((masked, k_noise))
  ref = Reference(timm_parity.timm_model(CFG, sd), B, noise_patch=8, views=views)

  state, counts = ad.init_state(), []
  valid = np.ones(B, bool)
  for x, (masked, k_noise) in zip(xs, keys):
    state, logits, metrics = step(ad.frozen, state, x, valid, masked, k_noise)
    t_logits = ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    float_checks.assert_predictions_match(t_logits.argmax(-1), np.asarray(logits))
    np.testing.assert_allclose(np.asarray(logits), t_logits, atol=1e-4, rtol=1e-4)
    counts.append((int(metrics["num_selected_mask"]), int(metrics["num_selected_noise"])))
  print(f"spa: selected per step (masked view, noisy view) jax {counts} torch {ref.counts}; "
        f"smallest confidence gap {min(ref.conf_gaps):.2e}")
  assert counts == ref.counts
  assert min(ref.conf_gaps) > 1e-5  # no selection decided by float noise
  for view in range(2):  # each selection keeps some samples and drops others
    per_step = [c[view] for c in counts]
    assert 0 < sum(per_step) < B * STEPS and any(0 < c < B for c in per_step), per_step

  def named(trainable):
    flat = dict(trainable)
    out = {"predictor.weight": np.asarray(flat.pop(spa.PREDICTOR)["kernel"]).T,
           "alpha": np.asarray(flat.pop(spa.NOISE)["alpha"])}
    timm = weights.flax_to_timm(spa.model_params(ad.params(state.replace(trainable=trainable))))
    ts = ref.adapted_state()
    out.update({k: np.asarray(v) for k, v in timm.items() if k in ts and k not in out})
    return out

  js, src = named(state.trainable), named(ad.init_state().trainable)
  worst, worst_update, excess = float_checks.compare_updates(js, src, ref.adapted_state())
  print(f"spa: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4
  assert excess <= 0, excess
