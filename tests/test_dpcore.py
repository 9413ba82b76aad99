"""DPCore: its batch statistics, source statistics, both branches (a coreset entry appended by the new one, moved
by the known one), the ring once the coreset is full, and agreement with the PyTorch reference written from the
official ``zybeich/DPCore`` code (``benchmarks/torch_methods/dpcore.py``) on a stream of two domains where both
branches fire."""

from __future__ import annotations

import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import split
from pcsr_jax.methods.dpcore import PROMPTS, batch_stats
from pcsr_jax.models import create
from tiny import batches, tiny_model

# On the 12-block random model the prompted entropies are 1.5-2.2 (ln 10 = 2.3): a margin of 2.0 keeps some
# source images and drops others. Two domains: noise, then noise shifted by 2.
MARGIN = 2.0
STEPS_NEW = 5


def _stream(b: int = agreement.B) -> list[np.ndarray]:
  rng = np.random.default_rng(3)
  x = lambda shift: (rng.standard_normal((b, 32, 32, 3)) + shift).astype(np.float32)
  return [x(0.0), x(0.0), x(2.0), x(2.0), x(2.0), x(2.0)]


def _source(n: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(7)
  images = rng.standard_normal((n, 32, 32, 3)).astype(np.float32)
  return [(images[i:i + 8], np.full(8, -1, np.int32)) for i in range(0, n, 8)]


def _adapter(model, params, source, **hp):
  method = methods.get("dpcore", **hp)
  prep = method.prepare(model, params, None, 8)
  frozen, trainable = split(prep.params, prep.is_trainable)
  stats = method.compute_source_stats(prep, frozen, trainable, iter(source))
  return engine.Adapter(method, model, params, batch_size=8, source_stats=stats), stats


def test_batch_stats_are_the_unbiased_ones_over_the_valid_rows():
  f = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
  valid = np.array([True] * 4 + [False] * 2)
  mean, std = batch_stats(f, valid)
  np.testing.assert_allclose(mean, f[:4].mean(0), rtol=1e-5)
  np.testing.assert_allclose(std, f[:4].std(0, ddof=1), rtol=1e-5)


def test_both_branches_the_coreset_and_its_ring():
  """The first batch is new (an empty coreset): an entry with the batch's raw statistics; a batch of the same
  domain is judged against it; the coreset holds one entry per new batch, and at capacity 2 a third new batch
  replaces the oldest."""
  model, params = tiny_model()
  source = [(x, np.full(8, -1, np.int32)) for x in batches(4, 8, seed=5)]
  hp = dict(source_kept=8, source_margin=2.2, steps_new=3)
  ad, _ = _adapter(model, params, source, **hp)
  state, seen = ad.init_state(), []
  for x in _stream(8):
    state, _, m = ad.step(state, x)
    seen.append((bool(m["known"]), int(m["coreset_size"])))
  print(f"dpcore (known, coreset size) per step: {seen}")
  assert not seen[0][0] and seen[0][1] == 1
  assert any(k for k, _ in seen) and sum(not k for k, _ in seen) == seen[-1][1]
  ring, _ = _adapter(model, params, source, coreset_capacity=1, thr_rho=1e-6, **hp)  # every batch new
  state = ring.init_state()
  for x in _stream(8)[:3]:
    state, _, m = ring.step(state, x)
  assert int(m["coreset_size"]) == 1 and bool(m["coreset_overflow"]) and int(state.extra.count) == 3


def test_too_few_source_images_through_the_filter_is_one_line():
  model, params = tiny_model()
  with pytest.raises(UserError, match=r"^dpcore: \d+ of 32 source images have an entropy below 0\.010"):
    _adapter(model, params, _source(), source_margin=0.01)
  with pytest.raises(UserError, match="dpcore source_margin"):
    methods.get("dpcore").threshold(4)  # ln 4 / 2 - 1 < 0


@pytest.mark.torch
def test_dpcore_matches_the_official_style_reference():
  """Same weights, prompts, source images and batches: the same source statistics; the same branch at every step
  (new on the first domain and at the shift, known after it), no branch decided by float noise, the same
  predictions and losses, the same coreset and prompts."""
  import torch

  from benchmarks.torch_methods.dpcore import source_statistics
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd = agreement.random_model()
  ad, stats = _adapter(create(agreement.CFG), weights.timm_to_flax(sd, agreement.CFG), _source(), source_kept=12,
                       source_margin=MARGIN, steps_new=STEPS_NEW)
  timm = timm_parity.timm_model(agreement.CFG, sd)
  prompts = np.asarray(ad.prep.params[PROMPTS]["tokens"])
  images = torch.from_numpy(np.concatenate([x for x, _ in _source()]).transpose(0, 3, 1, 2).copy())
  want = source_statistics(timm, images, prompts, 8, threshold=MARGIN, num_samples=12)
  assert want["kept"] == 12
  np.testing.assert_allclose(stats["mean"], want["mean"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(stats["std"], want["std"], rtol=1e-4, atol=1e-5)
  ref = make_reference("dpcore", timm, agreement.B, source_mean=want["mean"], source_std=want["std"],
                       prompt_init=prompts, steps_new=STEPS_NEW)
  state, trace = agreement.run(ad, ref, _stream(), logits_atol=2e-4)
  branches = ["known" if t["known"] else "new" for t in trace]
  print(f"dpcore: branches {branches}; (L0, L1) {[(round(a, 3), b and round(b, 3)) for a, b in ref.losses]}")
  assert branches == ref.branches and "known" in branches and branches.count("new") >= 2
  np.testing.assert_allclose([t["loss"] for t in trace], [a for a, _ in ref.losses], rtol=1e-4)
  assert min(abs(b - 0.8 * a) for a, b in ref.losses if b is not None) > 1e-2  # L1 < 0.8 L0, clearly either way
  n = len(ref.coreset)
  core = state.extra
  assert int(core.count) == n
  for j, e in enumerate(ref.coreset):
    np.testing.assert_allclose(np.asarray(core.means[j]), e["mean"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(core.stds[j]), e["std"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(core.prompts[j]), e["prompt"], rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(np.asarray(state.trainable[PROMPTS]["tokens"]), ref.prompts(), rtol=1e-3, atol=1e-4)
