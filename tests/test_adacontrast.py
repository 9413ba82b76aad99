"""AdaContrast: ring buffers, kNN pseudo-labels, the class-aware InfoNCE, and the PyTorch reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.adacontrast import class_aware_mask, instance_logits, knn_probs, ring_write
from pcsr_jax.models import ViTConfig, create
from tiny import tiny_model

SMALL = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


def test_ring_write_equals_a_numpy_ring_over_batches_with_wraparound_and_padding():
  rng = np.random.default_rng(0)
  k, d = 5, 2
  buf, ptr = np.zeros((k, d), np.float32), 0
  jbuf, jptr = jnp.zeros((k, d)), jnp.zeros((), jnp.int32)
  write = jax.jit(ring_write)
  for step in range(7):
    rows = rng.standard_normal((3, d)).astype(np.float32)
    valid = np.array([True, step % 3 != 1, step % 2 == 0])
    for r in rows[valid]:  # the numpy transcription: one row at a time at the pointer
      buf[ptr] = r
      ptr = (ptr + 1) % k
    jbuf, jptr = write(jbuf, jptr, jnp.asarray(rows), jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(jbuf), buf)
    assert int(jptr) == ptr
  assert ptr != 0  # the pointer went round more than once (17 rows into 5 slots) and is mid-ring


def test_knn_probs_equal_numpy_and_ignore_unfilled_slots():
  rng = np.random.default_rng(1)
  feats, bank = rng.standard_normal((4, 6)), rng.standard_normal((9, 6))
  probs = rng.dirichlet(np.ones(5), 9)
  filled = 7
  got = np.asarray(knn_probs(jnp.asarray(feats, jnp.float32), jnp.asarray(bank, jnp.float32),
                             jnp.asarray(probs, jnp.float32), jnp.asarray(filled), 3))
  norm = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  dist = 1 - norm(feats) @ norm(bank[:filled]).T
  want = probs[np.argsort(dist, axis=1)[:, :3]].mean(1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # An unfilled slot identical to a query is still never chosen.
  bank[8] = feats[0]
  got2 = np.asarray(knn_probs(jnp.asarray(feats, jnp.float32), jnp.asarray(bank, jnp.float32),
                              jnp.asarray(probs, jnp.float32), jnp.asarray(filled), 3))
  np.testing.assert_allclose(got2, got, rtol=1e-6)


def test_class_aware_infonce_equals_numpy():
  rng = np.random.default_rng(2)
  b, k, d, t = 4, 6, 5, 0.07
  norm = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  q, keys, queue = norm(rng.standard_normal((b, d))), norm(rng.standard_normal((b, d))), norm(
      rng.standard_normal((k, d)))
  labels, queue_labels = np.array([0, 1, 2, 1]), np.array([1, 1, 0, 3, 2, 0])
  mask = np.asarray(class_aware_mask(jnp.asarray(labels), jnp.asarray(queue_labels)))
  want_mask = np.concatenate([np.ones((b, 1), bool), labels[:, None] != queue_labels[None]], 1)
  np.testing.assert_array_equal(mask, want_mask)
  assert 0 < (~mask).sum() < mask.size
  logits = np.asarray(instance_logits(*(jnp.asarray(a, jnp.float32) for a in (q, keys, queue)), t))
  want = np.concatenate([(q * keys).sum(1, keepdims=True), q @ queue.T], 1) / t
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  # The loss with masked negatives: -log(exp(pos) / (exp(pos) + sum of the kept negatives' exp)).
  masked = jnp.where(jnp.asarray(mask), jnp.asarray(logits), -jnp.inf)
  got = -np.asarray(jax.nn.log_softmax(masked, axis=1))[:, 0]
  e = np.exp(want.astype(np.float64))
  np.testing.assert_allclose(got, -np.log(e[:, 0] / (e * want_mask).sum(1)), rtol=1e-5)


@pytest.mark.slow
def test_adacontrast_hyperparameters_and_engine_step():
  model, params = tiny_model()
  with pytest.raises(UserError, match="queue_size"):
    methods.get("adacontrast", queue_size=4, num_neighbors=10)
  with pytest.raises(UserError, match="queue_size"):
    engine.Adapter(methods.get("adacontrast", queue_size=16, num_neighbors=2), model, params, batch_size=32)
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("adacontrast"), model, params, batch_size=2, eval_order="before")
  ad = engine.Adapter(methods.get("adacontrast", queue_size=8, num_neighbors=2, warmup=4), model, params,
                      batch_size=4)
  assert ad.num_trainable == sum(np.size(x) for x in jax.tree.leaves(params))
  state = ad.init_state()
  x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)
  knn = []
  for n in (4, 4, 3):
    state, logits, metrics = ad.step(state, x[:n])
    knn.append(int(metrics["knn"]))
    assert bool(metrics["finite"])
  assert knn == [0, 1, 1] and int(state.extra.bank_filled) == 8 and int(state.extra.queue_ptr) == 3
  assert ad.num_traces == 1


@pytest.mark.torch
def test_adacontrast_matches_the_dt_style_reference_on_fixed_views():
  """Same weights, initial queue and views on both sides; queue 10 (wraps mid-batch), kNN from the
  third batch on, a ragged last batch: identical predictions (after the update), logits within 1e-4, the same
  pseudo-labels and queue labels, and params within 1e-4 of the update size."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(SMALL)
  b, kq = 4, 10
  hp = dict(queue_size=kq, num_neighbors=1, warmup=8)
  method = methods.get("adacontrast", **hp)
  ad = engine.Adapter(method, create(SMALL), weights.timm_to_flax(sd, SMALL), batch_size=b)
  state = ad.init_state()
  rng = np.random.default_rng(0)
  sizes = (b, b, b, b, 3)
  stream = [rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for n in sizes]
  views = [tuple(rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for _ in range(3)) for n in sizes]
  feed = iter([tuple(torch.from_numpy(v.transpose(0, 3, 1, 2)) for v in vs) for vs in views])
  ref = make_reference("adacontrast", timm_parity.timm_model(SMALL, sd), b, queue=np.asarray(state.extra.queue),
                       queue_labels=np.asarray(state.extra.queue_labels), view_source=feed, **hp)
  src = weights.flax_to_timm(ad.params(state))

  @jax.jit
  def step(s, x, ok, vs):
    s, _, metrics = method.adapt(ad.prep, ad.frozen, s, x, ok, vs)
    return s, method.forward(ad.prep, ad.frozen, s.trainable, x)[0], metrics

  worst, knn, masked = 0.0, [], []
  for x, vs in zip(stream, views):
    n = len(x)
    xp, ok = ad.pad(x)
    vp = tuple(ad.pad(v)[0] for v in vs)
    ptr = int(state.extra.queue_ptr)
    state, logits, metrics = step(state, xp, ok, vp)
    logits = np.asarray(logits)[:n]
    t_logits = ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    labels = np.asarray(state.extra.queue_labels)[(ptr + np.arange(n)) % kq]
    np.testing.assert_array_equal(labels, ref.last_labels.numpy())
    np.testing.assert_array_equal(np.asarray(state.extra.queue_labels), ref.mem_labels.numpy())
    float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
    np.testing.assert_allclose(logits, t_logits, atol=1e-4, rtol=1e-4)
    worst = max(worst, float(np.abs(logits - t_logits).max() / np.abs(t_logits).max()))
    knn.append(int(metrics["knn"]))
    masked.append(int((labels[:, None] == np.asarray(state.extra.queue_labels)[None]).sum()))
  np.testing.assert_allclose(np.asarray(state.extra.bank_feats), ref.banks["features"].numpy(), atol=1e-4)
  rel, rel_update, excess = float_checks.compare_updates(weights.flax_to_timm(ad.params(state)), src,
                                                         ref.adapted_state())
  print(f"adacontrast: kNN per batch {knn}; masked negatives per batch {masked} of {[n * kq for n in sizes]}; "
        f"logits max rel diff {worst:.2e}; params max rel diff {rel:.2e}, updates {rel_update:.2e}")
  assert knn == [0, 0, 1, 1, 1] and all(0 < m < n * kq for m, n in zip(masked, sizes))
  assert excess <= 0
