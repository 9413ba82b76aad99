"""Each loss against a naive numpy formula."""

from __future__ import annotations

import math

import numpy as np

from pcsr_jax import losses


def np_entropy(logits):
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return -(p * np.log(p)).sum(-1)


def test_entropy_matches_numpy():
  logits = np.random.default_rng(0).standard_normal((7, 1000)).astype(np.float32) * 3
  np.testing.assert_allclose(np.asarray(losses.entropy(logits)), np_entropy(logits.astype(np.float64)), rtol=1e-5)


def test_margin_is_sar_e0():
  assert losses.entropy_margin(1000) == 0.4 * math.log(1000)


def test_masked_mean_and_empty_mask():
  x = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
  assert float(losses.masked_mean(x, np.array([1, 0, 1, 0], bool))) == 2.5
  assert float(losses.masked_mean(x, np.zeros(4, bool))) == 0.0  # not NaN


def test_reliable_mask_is_strict():
  ent = np.array([0.5, 1.0, 1.5], np.float32)
  mask = losses.reliable_mask(ent, 1.0, np.ones(3, bool))
  assert np.asarray(mask).tolist() == [True, False, False]  # ent == E0 is not reliable
  assert np.asarray(losses.reliable_mask(ent, 2.0, np.array([1, 1, 0], bool))).tolist() == [True, True, False]


def naive_mean_cosine(f):
  """(1/N^2) sum_{j,k} cos(f_j, f_k) with the full N x N matrix (PCSR eq. 2)."""
  b, n, _ = f.shape
  out = np.zeros(b)
  for i in range(b):
    for j in range(n):
      for k in range(n):
        out[i] += f[i, j] @ f[i, k] / (np.linalg.norm(f[i, j]) * np.linalg.norm(f[i, k]))
  return out / n ** 2


def test_linear_time_similarity_equals_naive_quadratic_formula():
  f = np.random.default_rng(1).standard_normal((3, 17, 8))
  f[1] += 2.0  # a batch element with strongly aligned tokens
  np.testing.assert_allclose(np.asarray(losses.mean_pairwise_cosine(f.astype(np.float32))), naive_mean_cosine(f),
                             rtol=1e-5, atol=1e-6)


def test_similarity_loss_eq3():
  sims = np.random.default_rng(2).uniform(size=(4, 5)).astype(np.float32)  # [L, B]
  valid = np.array([1, 1, 1, 0, 0], bool)
  expected = -sims[:, :3].mean(axis=0).mean()  # -(1/L) sum_l, averaged over the batch
  np.testing.assert_allclose(float(losses.similarity_loss(sims, valid)), expected, rtol=1e-6)
