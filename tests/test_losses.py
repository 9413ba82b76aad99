"""Each loss against a naive numpy formula."""

from __future__ import annotations

import math

import numpy as np
import pytest

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


def np_come_entropy(z: np.ndarray) -> np.ndarray:
  """COME's ``dirichlet_entropy`` in float64, as its code computes it (unshifted exp, 1000, 1e-7)."""
  e = np.exp(z)
  s = e.sum(-1, keepdims=True) + 1000.0
  p = np.concatenate([e / s, 1000.0 / s], axis=-1) + 1e-7
  return -(p * np.log(p)).sum(-1)


def test_come_entropy_matches_the_official_form_and_survives_large_logits():
  """`losses.come_entropy`: COME's value (float64 transcription, 1e-5), its gradient orthogonal to the logits
  (the norm detached, as the official code detaches it: the gradient turns the
  logits; `test_come_entropy_gradient_is_the_official_codes`), and finite where the official's unshifted exp
  overflows float32 (a logit above 88)."""
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(0)
  z = np.concatenate([rng.normal(0, s, (8, 1000)) for s in (0.5, 2.0, 6.0)]).astype(np.float32)
  got = np.asarray(losses.come_entropy(jnp.asarray(z)))
  np.testing.assert_allclose(got, np_come_entropy(z.astype(np.float64)), rtol=1e-5, atol=1e-6)
  g = np.asarray(jax.grad(lambda x: losses.come_entropy(x).sum())(jnp.asarray(z)))
  assert np.abs((g * z).sum(-1)).max() < 1e-4 * np.abs(g).sum(-1).max() * np.abs(z).max()  # turns z only
  big = z[:2] * 0 + np.linspace(-5, 120, 1000, dtype=np.float32)
  assert np.isfinite(np.asarray(losses.come_entropy(jnp.asarray(big)))).all()
  np.testing.assert_array_equal(np.asarray(losses.adaptation_entropy(jnp.asarray(z), "come")), got)


@pytest.mark.torch
def test_come_entropy_gradient_is_the_official_codes():
  import jax
  import jax.numpy as jnp
  import torch

  from benchmarks.torch_reference import dirichlet_entropy

  z = np.random.default_rng(1).normal(0, 3, (16, 1000)).astype(np.float32)
  g = np.asarray(jax.grad(lambda x: losses.come_entropy(x).sum())(jnp.asarray(z)))
  t = torch.from_numpy(z).requires_grad_(True)
  dirichlet_entropy(t).sum().backward()
  np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-3, atol=1e-7)
