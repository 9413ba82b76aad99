"""VCT: its tokens, the zeroed instance token whose momentum stays, the prediction after the update, and agreement
with the PyTorch reference written from the official ``yushuntang/VCT`` code (``benchmarks/torch_methods/vct.py``)
on a plain stream and on one where SAR's reset fires on and off."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.methods.base import is_block_layernorm_param
from pcsr_jax.methods.vct import INSTANCE
from test_methods import flat_paths
from tiny import batches, tiny_model


def test_class_token_instance_token_and_sars_layernorms_adapt():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("vct", skip_blocks=(1,)), model, params, batch_size=4)
  paths = flat_paths(ad.init_state().trainable)
  norms = {p for p in flat_paths(params) if is_block_layernorm_param(tuple(p.split("/")), (1,))}
  assert paths == norms | {"cls_token", f"{INSTANCE}/token"}
  assert ad.prep.params[INSTANCE]["token"].shape == (4, 1, model.config.embed_dim)


def test_a_zero_instance_token_is_the_plain_model_and_the_token_is_zeroed_after_each_step():
  """At the start VCT's model is the source model; after a step the instance token is zero again while its
  momentum is not, so the next step starts from ``-lr * (0.9 buf + g)``; the reported logits are the third
  forward's, after the update (not the first forward's)."""
  model, params = tiny_model()
  x = batches(2, 8)
  ad = engine.Adapter(methods.get("vct", margin_factor=2.0, lr=0.05), model, params, batch_size=8)
  src = engine.Adapter(methods.get("source"), model, params, batch_size=8)
  before = engine.Adapter(methods.get("vct", margin_factor=2.0, lr=0.05), model, params, batch_size=8,
                          eval_order="before")
  _, source_logits, _ = src.step(src.init_state(), x[0])
  _, first_logits, _ = before.step(before.init_state(), x[0])
  np.testing.assert_allclose(np.asarray(first_logits), np.asarray(source_logits), rtol=1e-5, atol=1e-6)
  state, after_logits, m = ad.step(ad.init_state(), x[0])
  assert int(m["num_reliable"]) > 0 and not np.allclose(np.asarray(after_logits), np.asarray(source_logits))
  assert not np.any(np.asarray(state.trainable[INSTANCE]["token"]))
  momentum = [np.abs(np.asarray(v)).max() for v in jax.tree.leaves(state.opt_state) if np.ndim(v) == 3]
  assert momentum and max(momentum) > 0  # the instance token's momentum buffer


@pytest.mark.torch
@pytest.mark.parametrize("case", ["plain", "resets"])
def test_vct_matches_the_official_style_reference(case):
  """Same weights and batches: identical predictions (the third forward's) at every step, the same filter counts,
  EMA and resets, and the same adapted tokens and LayerNorms. The reset stream (LayerNorm lr 1.0, threshold 1.6)
  resets at some steps and not at others, the second filter removes samples, and every EMA value is 3e-3 or more
  from the threshold."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  margin = 0.9
  hp, steps, seed = {"plain": ({}, 5, 0), "resets": (dict(lr=1.0, reset_constant=1.6), 9, 2)}[case]
  sd = agreement.random_model()
  ad = agreement.adapter("vct", sd, margin_factor=margin, **hp)
  ref = make_reference("vct", timm_parity.timm_model(agreement.CFG, sd), agreement.B,
                       margin=margin * np.log(agreement.CFG.num_classes), lr_norm=hp.get("lr"),
                       reset_constant=hp.get("reset_constant", 0.2))
  state, trace = agreement.run(ad, ref, agreement.stream(steps, seed=seed))
  agreement.check_sar_stream(f"vct {case}", trace, ref, state, hp.get("reset_constant") if case == "resets" else None)
  instance = lambda params: {"instance_token": np.asarray(params[INSTANCE]["token"])}
  worst, worst_update = agreement.compare(ad, state, ref, instance)
  print(f"vct {case}: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
