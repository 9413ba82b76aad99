"""MEMO: episodic per-image adaptation, the marginal entropy, the vmapped images and the PyTorch reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.memo import marginal_entropy
from pcsr_jax.models import ViTConfig, create
from tiny import tiny_model

SMALL = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


def numpy_marginal_entropy(logits: np.ndarray) -> float:
  z = logits.astype(np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  avg = p.mean(0)
  return float(-(avg * np.log(avg)).sum())


def test_marginal_entropy_is_the_entropy_of_the_mean_softmax():
  logits = np.random.default_rng(0).standard_normal((7, 10)).astype(np.float32) * 4
  ent, avg = marginal_entropy(jnp.asarray(logits))
  np.testing.assert_allclose(float(ent), numpy_marginal_entropy(logits), rtol=1e-5)
  np.testing.assert_allclose(np.exp(np.asarray(avg)).sum(), 1.0, rtol=1e-5)
  # One-hot views: the average of a probability 1 puts -inf in log space; the clamp keeps it finite.
  hard = np.full((2, 3), -1e30, np.float32)
  hard[0, 0] = hard[1, 0] = 0.0
  assert np.isfinite(float(marginal_entropy(jnp.asarray(hard))[0]))


def _setup(views=4, chunk=2, batch=3):
  model, params = tiny_model()
  method = methods.get("memo", views=views, chunk=chunk)
  ad = engine.Adapter(method, model, params, batch_size=batch)
  return method, ad


def _adapt(method, ad, state, images, valid, views):
  fn = jax.jit(lambda s, x, v, vw: method.adapt(ad.prep, ad.frozen, s, x, v, vw))
  return fn(state, jnp.asarray(images), jnp.asarray(valid), jnp.asarray(views))


@pytest.mark.slow
def test_vmapped_images_equal_a_per_image_loop_and_each_image_starts_from_the_source():
  """chunk 2 over 3 images (a remainder chunk) equals adapting each image alone:
  one AdamW step from the source params and a fresh optimizer state, written out here with optax."""
  method, ad = _setup()
  rng = np.random.default_rng(0)
  images = rng.standard_normal((3, 32, 32, 3)).astype(np.float32)
  views = rng.standard_normal((3, 4, 32, 32, 3)).astype(np.float32)
  state = ad.init_state()
  _, logits, metrics = _adapt(method, ad, state, images, np.ones(3, bool), views)
  params = ad.params(state)
  tx = optax.adamw(1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  model = ad.prep.model

  @jax.jit
  def alone(image, vw):
    loss, g = jax.value_and_grad(lambda p: marginal_entropy(model.apply({"params": p}, vw))[0])(params)
    u, _ = tx.update(g, tx.init(params), params)
    return loss, model.apply({"params": optax.apply_updates(params, u)}, image[None])[0]

  losses = []
  for i in range(3):
    loss, want = alone(images[i], views[i])
    np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(want), rtol=1e-5, atol=1e-5)
    losses.append(float(loss))
  np.testing.assert_allclose(float(metrics["loss"]), np.mean(losses), rtol=1e-5)
  # The update moved the prediction (it is not the source model's).
  assert np.abs(np.asarray(logits) - np.asarray(model.apply({"params": params}, images))).max() > 1e-6


@pytest.mark.slow
def test_episodic_same_image_same_prediction_whatever_came_before():
  """Through the engine (views drawn from the state's key): an image's prediction depends on nothing that
  came before it. The state's params never move; only the key advances, so fixing the key fixes the views."""
  method, ad = _setup(views=2, batch=2)
  rng = np.random.default_rng(1)
  target = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
  fresh = ad.init_state()
  key = fresh.rng
  _, first, _ = ad.step(ad.init_state(), target)
  state = ad.init_state()
  for _ in range(2):
    state, _, _ = ad.step(state, rng.standard_normal((2, 32, 32, 3)).astype(np.float32))
  src = jax.tree.map(np.asarray, ad.init_state().trainable)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.trainable, src)
  _, again, _ = ad.step(state.replace(rng=key), target[:1])  # a ragged batch: the first image alone
  np.testing.assert_array_equal(np.asarray(first)[0], np.asarray(again)[0])
  assert np.all(np.isfinite(np.asarray(first))) and ad.num_traces == 1


def test_memo_hyperparameters_and_eval_order():
  model, params = tiny_model()
  with pytest.raises(UserError, match="views"):
    methods.get("memo", views=0)
  with pytest.raises(UserError, match="chunk"):
    methods.get("memo", chunk=0)
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("memo"), model, params, batch_size=2, eval_order="after")
  ad = engine.Adapter(methods.get("memo", views=2), model, params, batch_size=2)
  assert ad.num_trainable == sum(np.size(x) for x in jax.tree.leaves(params))
  assert methods.get("memo").cost == "65F+64B"


@pytest.mark.torch
def test_memo_matches_the_official_style_reference_on_fixed_views():
  """Same weights and the same 4 views per image on both sides, a ragged last batch: identical predictions,
  logits within 1e-4, and the last image's adapted params within 1e-4 of the update size."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(SMALL)
  b, v = 3, 4
  method = methods.get("memo", views=v, chunk=2)
  ad = engine.Adapter(method, create(SMALL), weights.timm_to_flax(sd, SMALL), batch_size=b)
  rng = np.random.default_rng(0)
  stream = [rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for n in (b, b, 2)]
  all_views = [rng.standard_normal((len(x), v, 32, 32, 3)).astype(np.float32) for x in stream]
  feed = iter([torch.from_numpy(vw.transpose(0, 3, 1, 2)) for vs in all_views for vw in vs])
  ref = make_reference("memo", timm_parity.timm_model(SMALL, sd), b, views=v, view_source=feed)
  adapt = jax.jit(lambda s, x, ok, vw: method.adapt(ad.prep, ad.frozen, s, x, ok, vw))
  state, worst = ad.init_state(), 0.0
  for x, vs in zip(stream, all_views):
    n = len(x)
    xp, ok = ad.pad(x)
    vp = np.concatenate([vs, np.zeros((b - n,) + vs.shape[1:], np.float32)])
    state, logits, _ = adapt(state, xp, ok, vp)
    logits = np.asarray(logits)[:n]
    t_logits = ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
    np.testing.assert_allclose(logits, t_logits, atol=1e-4, rtol=1e-4)
    worst = max(worst, float(np.abs(logits - t_logits).max() / np.abs(t_logits).max()))
  adapted, _ = jax.jit(lambda s, vw: method.adapted_params(ad.prep, ad.frozen, s, vw))(state, vs[-1])
  js = weights.flax_to_timm(ad.params(state.replace(trainable=adapted)))
  src = weights.flax_to_timm(ad.params(state))
  ts = ref.adapted_state()
  js = {k: js[k].copy() for k in ts}
  # The key bias (the middle third of qkv.bias) has an analytically zero gradient (it adds the same q.b_k to
  # every attention logit of a row); both sides compute float noise ~1e-10 there, which AdamW's first step
  # turns into an arbitrary update of up to lr. Those entries are checked against that bound, not each other.
  d = SMALL.embed_dim
  for i in range(SMALL.depth):
    k = f"blocks.{i}.attn.qkv.bias"
    for upd in (js[k] - src[k], ts[k] - src[k]):
      assert np.abs(upd[d:2 * d]).max() <= 1e-5 * (1 + 0.01 * np.abs(src[k]).max()) + 1e-7
    js[k][d:2 * d] = ts[k][d:2 * d] = src[k][d:2 * d]
  rel, rel_update, excess = float_checks.compare_updates(js, src, ts)
  print(f"memo: logits max rel diff {worst:.2e}; params max rel diff {rel:.2e}, updates {rel_update:.2e}")
  assert excess <= 0
