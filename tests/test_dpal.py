"""DPAL: the prompted model with zero predictors is the source model, what the similarity term does (nothing to
the update, as the note on the code says), and agreement with the PyTorch reference written from the official
``yushuntang/DPAL`` code (``benchmarks/torch_methods/dpal.py``) on a plain stream and one where the reset fires."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.methods.base import merge
from pcsr_jax.methods.dpal import noise_similarity
from pcsr_jax.models import dpal
from tiny import batches, tiny_model


def test_the_noise_similarity_is_minus_the_mean_cosine():
  rng = np.random.default_rng(0)
  n = rng.standard_normal((5, 3, 4)).astype(np.float32)  # [B, L, D]
  u = n / np.linalg.norm(n, axis=-1, keepdims=True)
  want = -np.mean([np.mean(u[:, layer] @ u[:, layer].T) for layer in range(3)])
  np.testing.assert_allclose(noise_similarity(n, np.ones(5, bool)), want, rtol=1e-5)
  valid = np.array([True, True, True, False, False])
  np.testing.assert_allclose(noise_similarity(n, valid), noise_similarity(n[:3], valid[:3]), rtol=1e-6)
  assert float(noise_similarity(np.zeros_like(n), np.ones(5, bool))) == 0.0


def test_the_similarity_term_has_no_gradient_and_only_fc2_bias_moves():
  """The code's zero init: at the start the noise is zero (sim 0) and its gradient is exactly zero; after steps
  every layer's noise rows are equal (sim -1) and its gradient is float rounding, 1e-5 of the entropy's at most;
  of the predictors only fc2's bias ever moves."""
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("dpal", margin_factor=2.0, lr_predictor=0.5), model, params, batch_size=8)
  xs = batches(4, 8)
  valid = np.ones(8, bool)

  def sim_and_entropy_grads(trainable, x):
    def sim(t):
      _, noises = ad.prep.model.apply({"params": merge(ad.frozen, t)}, x, noises=True)
      return noise_similarity(noises, valid)

    def ent(t):
      logits = ad.prep.model.apply({"params": merge(ad.frozen, t)}, x)
      return jax.nn.log_softmax(logits).max(-1).mean()

    return sim(trainable), jax.grad(sim)(trainable), jax.grad(ent)(trainable)

  state = ad.init_state()
  value, g, _ = sim_and_entropy_grads(state.trainable, xs[0])
  assert float(value) == 0.0 and all(not np.any(np.asarray(v)) for v in jax.tree.leaves(g))
  for x in xs[:3]:
    state, _, m = ad.step(state, x)
  assert int(state.resets) == 0 and float(m["similarity_loss"]) == pytest.approx(-1.0, abs=1e-6)
  value, g, g_ent = sim_and_entropy_grads(state.trainable, xs[3])
  largest = max(np.abs(np.asarray(v)).max() for v in jax.tree.leaves(g))
  assert largest <= 1e-5 * max(np.abs(np.asarray(v)).max() for v in jax.tree.leaves(g_ent)), largest
  for i in range(model.config.depth):
    pred = state.trainable[f"{dpal.PRED}{i}"]
    assert not np.any(np.asarray(pred["fc1"]["kernel"])) and not np.any(np.asarray(pred["fc1"]["bias"]))
    assert not np.any(np.asarray(pred["fc2"]["kernel"])) and np.any(np.asarray(pred["fc2"]["bias"]))


def test_with_zero_predictors_the_class_token_is_the_prompted_models():
  """Zero predictors subtract GELU(0) = 0; the prompts change the logits (they join the attention)."""
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("dpal"), model, params, batch_size=4)
  x = batches(1, 4)[0]
  full = ad.prep.params
  logits, noises = ad.prep.model.apply({"params": full}, x, noises=True)
  assert noises.shape == (4, model.config.depth, model.config.embed_dim) and not np.any(np.asarray(noises))
  plain = model.apply({"params": params}, x)
  assert not np.allclose(np.asarray(logits), np.asarray(plain), atol=1e-4)
  bound = np.sqrt(6 / (3 * model.config.patch_size ** 2 + model.config.embed_dim))
  assert 0 < np.abs(np.asarray(full[dpal.DEEP])).max() <= bound
  assert full[dpal.DEEP].shape == (model.config.depth - 1, 1, model.config.embed_dim)


@pytest.mark.torch
@pytest.mark.parametrize("case", ["plain", "resets"])
def test_dpal_matches_the_official_style_reference(case):
  """Same weights, prompts and batches: identical predictions (forward 2's, at the perturbed weights), the same
  filter counts, similarity values, EMA and resets, the same adapted LayerNorms, prompts and predictors."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  margin = 0.9
  hp, steps, seed = {"plain": ({}, 5, 3), "resets": (dict(lr_norm=0.1, lr_prompt=0.1, lr_predictor=0.1,
                                                          reset_constant=1.85), 9, 2)}[case]
  sd = agreement.random_model()
  ad = agreement.adapter("dpal", sd, margin_factor=margin, **hp)
  p = ad.prep.params
  ref = make_reference("dpal", timm_parity.timm_model(agreement.CFG, sd), agreement.B,
                       margin=margin * np.log(agreement.CFG.num_classes),
                       prompt_init={"prompt_embeddings": np.asarray(p[dpal.PROMPT]),
                                    "deep_prompt_embeddings": np.asarray(p[dpal.DEEP])},
                       lr=hp.get("lr_norm", 0.01), lr_predictor=hp.get("lr_predictor", 0.01),
                       reset_constant=hp.get("reset_constant", 0.2))
  state, trace = agreement.run(ad, ref, agreement.stream(steps, seed=seed))
  agreement.check_sar_stream(f"dpal {case}", trace, ref, state, hp.get("reset_constant") if case == "resets" else None)
  print(f"dpal {case}: similarity per step {[round(t['similarity_loss'], 4) for t in trace]}")
  np.testing.assert_allclose([t["similarity_loss"] for t in trace], ref.sims, atol=1e-5)

  def extra(params):
    out = {"prompt_embeddings": np.asarray(params[dpal.PROMPT]),
           "deep_prompt_embeddings": np.asarray(params[dpal.DEEP])}
    for i in range(agreement.CFG.depth):
      for fc in ("fc1", "fc2"):
        out[f"predictors.{i}.{fc}.weight"] = np.asarray(params[f"{dpal.PRED}{i}"][fc]["kernel"]).T
        out[f"predictors.{i}.{fc}.bias"] = np.asarray(params[f"{dpal.PRED}{i}"][fc]["bias"])
    return out

  # The predictors' updates carry the similarity term's gradient, float rounding of order 1e-6 (the module
  # docstring): there the two programs agree to 2% of the update, everywhere else to 1e-4.
  worst, worst_update = agreement.compare(ad, state, ref, extra, loose=("predictors.", 2e-2))
  print(f"dpal {case}: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")


def test_dpal_param_groups():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("dpal", skip_blocks=(1,)), model, params, batch_size=4)
  t = ad.init_state().trainable
  assert {dpal.PROMPT, dpal.DEEP} <= set(t) and all(f"{dpal.PRED}{i}" in t for i in range(model.config.depth))
  assert "blocks_1" not in t and "norm" not in t and "blocks_0" in t
  assert jnp.all(ad.prep.params[dpal.PROMPT] != 0)
