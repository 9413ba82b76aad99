"""Losses of online test-time adaptation, all mask-aware and NaN-free.

Every reduction takes a boolean ``mask`` over the batch (padding of a ragged
last batch, or an entropy filter). An empty mask gives 0 -- a well-defined zero
gradient -- where PyTorch's ``x[mask].mean()`` would give NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def entropy(logits: Array) -> Array:
  """Shannon entropy of softmax(logits) per sample, ``[B, C] -> [B]`` (nats)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


LOSSES = ("entropy", "come")  # what TENT, SAR and EATA minimize (their ``loss`` field)


def come_entropy(logits: Array, uncertainty: float = 1000.0, eps: float = 1e-7) -> Array:
  """COME's entropy (Zhang et al., ICLR 2025; ``dirichlet_entropy`` of the official ``tent_come.py``,
  ``sar_come.py``, ``eata_come.py``), ``[B, K] -> [B]``: the logits ``z`` rescaled as ``z / ||z|| * sg(||z||)``
  (the same values; the gradient only turns ``z``), ``e = exp(z)``, ``S = sum(e) + 1000``, and the entropy of
  the K+1 entries ``[e / S, 1000 / S] + 1e-7``. The official exponentiates unshifted (float32 overflow above a
  logit of 88); here ``e`` and ``S`` are divided by ``exp(max(max z, 0))`` first, the same numbers."""
  z = logits.astype(jnp.float32)
  n = jnp.linalg.norm(z, axis=-1, keepdims=True)
  z = z / n * jax.lax.stop_gradient(n)
  m = jax.lax.stop_gradient(jnp.maximum(z.max(-1, keepdims=True), 0.0))
  e, u = jnp.exp(z - m), uncertainty * jnp.exp(-m)
  s = e.sum(-1, keepdims=True) + u
  p = jnp.concatenate([e / s, u / s], axis=-1) + eps
  return -jnp.sum(p * jnp.log(p), axis=-1)


def adaptation_entropy(logits: Array, loss: str) -> Array:
  """Per-sample ``entropy`` (``loss`` 'entropy') or `come_entropy` ('come')."""
  return come_entropy(logits) if loss == "come" else entropy(logits)


def entropy_margin(num_classes: int, factor: float = 0.4) -> float:
  """SAR's reliability threshold E0 = factor * ln(C) (0.4 ln 1000 on ImageNet)."""
  return factor * math.log(num_classes)


def masked_mean(x: Array, mask: Array) -> Array:
  """Mean of ``x`` over ``mask``; 0 (not NaN) when the mask is empty."""
  mask = mask.astype(x.dtype)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def reliable_mask(ent: Array, margin: float, valid: Array) -> Array:
  """Samples with entropy strictly below the margin (SAR eq. 2; PCSR eq. 8)."""
  return (ent < margin) & valid


def mean_pairwise_cosine(f: Array, eps: float = 1e-8) -> Array:
  """``mean_{j,k} cos(f_j, f_k)`` over the token axis in O(N d), ``[..., N, d] -> [...]``.

  The double sum factorizes: ``(1/N^2) sum_{j,k} <u_j, u_k> = ||(1/N) sum_j u_j||^2``
  with ``u_j = f_j / ||f_j||`` -- the O(N^2 d) similarity matrix of PCSR eq. 2
  is never formed.
  """
  f = f.astype(jnp.float32)
  u = f / jnp.maximum(jnp.linalg.norm(f, axis=-1, keepdims=True), eps)
  m = jnp.mean(u, axis=-2)
  return jnp.sum(m * m, axis=-1)


def similarity_loss(per_layer_sim: Array, valid: Array) -> Array:
  """PCSR eq. 3: ``-(1/L) sum_l mean_{j,k} M^l_jk``, averaged over the valid samples.

  ``per_layer_sim`` is ``[L, B]``: the mean pairwise cosine of every layer's
  DSN outputs, per sample.
  """
  return -masked_mean(jnp.mean(per_layer_sim, axis=0), valid)
