"""REM: the views' kept patches (the least attended, counted as the code counts them), the losses, and agreement
with the PyTorch reference written from the official ``pilsHan/rem`` code (``benchmarks/torch_methods/rem.py``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import SAR_SKIP_BLOCKS, is_block_layernorm_param
from test_methods import flat_paths
from tiny import batches, tiny_model


def test_views_keep_the_codes_counts_and_the_least_attended_patches():
  rem = methods.get("rem")
  assert rem.kept_counts(196) == [176, 156] and rem.kept_counts(16) == [14, 12]
  model, params = tiny_model()
  ad = engine.Adapter(rem, model, params, batch_size=4)
  x = batches(1, 4)[0]
  full = ad.prep.params
  logits, weights = model.apply({"params": full}, x, cls_attention=True)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)  # a softmax row over every token
  _, (_, _, _, kept) = rem.loss(ad.prep, ad.frozen, ad.init_state().trainable, x, np.ones(4, bool))
  w = np.asarray(weights)[:, 1:]
  for k, n in zip(kept, rem.kept_counts(model.config.num_patches)):
    k = np.asarray(k)
    assert k.shape == (4, n)
    dropped = np.array([np.setdiff1d(np.arange(w.shape[1]), row) for row in k])
    assert (np.take_along_axis(w, k, 1).max(1) <= np.take_along_axis(w, dropped, 1).min(1)).all()
  every = np.tile(np.arange(model.config.num_patches)[::-1], (4, 1))  # every patch, in another order
  np.testing.assert_allclose(np.asarray(model.apply({"params": full}, x, keep=every)), np.asarray(logits),
                             rtol=1e-5, atol=1e-5)


def test_adapted_set_and_bad_ratios():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("rem"), model, params, batch_size=4)
  norms = {p for p in flat_paths(params) if is_block_layernorm_param(tuple(p.split("/")), SAR_SKIP_BLOCKS)}
  assert flat_paths(ad.init_state().trainable) == norms
  with pytest.raises(UserError, match="rem mask_ratio, num_views"):
    methods.get("rem", mask_ratio=0.5, num_views=3)


def test_a_step_moves_the_layernorms_by_adams_first_step():
  """Adam's first step moves every adapted tensor with a nonzero gradient by lr (its normalised step) per element."""
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("rem", lr=0.01), model, params, batch_size=8)
  state0 = ad.init_state()
  source = jax.tree.map(np.array, state0.trainable)  # the step donates state0
  state, _, m = ad.step(state0, batches(1, 8)[0])
  assert float(m["mcl"]) > 0 and float(m["erl"]) >= 0
  moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(source))]
  assert max(moved) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.torch
def test_rem_matches_the_official_style_reference():
  """Same weights and batches: the same kept patches in every view, identical predictions (the full forward's),
  the same MCL and ERL, the same adapted LayerNorms (Adam at lr 5e-3: well above float noise)."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd = agreement.random_model()
  ad = agreement.adapter("rem", sd, lr=5e-3)
  ref = make_reference("rem", timm_parity.timm_model(agreement.CFG, sd), agreement.B, lr=5e-3)
  rem, kept = ad.method, []
  every = lambda state, x: kept.append(rem.loss(ad.prep, ad.frozen, state.trainable, x, np.ones(len(x), bool))[1][3])
  state, trace = agreement.run(ad, ref, agreement.stream(5), before=every)
  for mine, theirs in zip(kept, ref.kept, strict=True):
    for a, b in zip(mine, theirs, strict=True):
      np.testing.assert_array_equal(np.sort(np.asarray(a), -1), np.sort(b, -1))
  np.testing.assert_allclose([(t["mcl"], t["erl"]) for t in trace], ref.losses, rtol=1e-4, atol=1e-6)
  assert min(t["erl"] for t in trace) > 0  # the ranking term acts
  print(f"rem: (mcl, erl) per step {[(round(t['mcl'], 4), round(t['erl'], 4)) for t in trace]}")
  worst, worst_update = agreement.compare(ad, state, ref)
  print(f"rem: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
