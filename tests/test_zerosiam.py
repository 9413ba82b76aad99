"""ZeroSiam: what adapts, the loss at the identity init, and agreement with the PyTorch reference written from
the official ``Cascol-Chen/ZeroSiam`` code (``benchmarks/torch_methods/zerosiam.py``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, losses, methods
from pcsr_jax.methods.base import is_layernorm_param
from pcsr_jax.methods.zerosiam import PREDICTOR, symmetric_kl
from test_methods import flat_paths
from tiny import adapted_at_batch_one, batches, tiny_model


def test_every_layernorm_and_the_identity_predictor_adapt():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("zerosiam"), model, params, batch_size=4)
  paths = flat_paths(ad.init_state().trainable)
  norms = {p for p in flat_paths(params) if is_layernorm_param(tuple(p.split("/")))}
  assert paths == norms | {f"{PREDICTOR}/kernel"} and "norm/scale" in paths
  np.testing.assert_array_equal(ad.prep.params[PREDICTOR]["kernel"], np.eye(model.config.embed_dim))


def test_the_first_step_is_the_entropy_and_later_ones_add_the_kl():
  """At the identity the online branch is the target: the KL term is 0 and the loss is the mean entropy of the
  reported logits; once the predictor moved, the KL is positive."""
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("zerosiam", lr=0.05), model, params, batch_size=8)
  xs = batches(2, 8)
  state, logits, m = ad.step(ad.init_state(), xs[0])
  assert float(m["kl"]) == 0.0
  np.testing.assert_allclose(float(m["loss"]), float(losses.entropy(logits).mean()), rtol=1e-6)
  _, _, m = ad.step(state, xs[1])
  assert float(m["kl"]) > 0.0


def test_symmetric_kl_is_both_directions():
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((2, 5, 7)).astype(np.float32)
  p, q = jax.nn.softmax(a), jax.nn.softmax(b)
  kl = lambda x, y: np.sum(x * (np.log(x) - np.log(y)), -1)
  np.testing.assert_allclose(symmetric_kl(a, b), kl(q, p) + kl(p, q), rtol=1e-5)


def test_lr_doubles_at_batch_size_one():
  for a, b in zip(adapted_at_batch_one("zerosiam"),
                  adapted_at_batch_one("zerosiam", lr=2 * 0.001 / 64)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.torch
def test_zerosiam_matches_the_official_style_reference():
  """Same weights and batches, lr 0.05 for both groups (10x the default at B = 64: updates well above float noise):
  identical predictions, the same losses, the same adapted LayerNorms and predictor."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd = agreement.random_model(head_scale=2.0)
  hp = dict(lr=0.01, lr_scale=5.0, lr_p=5.0)
  ad = agreement.adapter("zerosiam", sd, **hp)
  ref = make_reference("zerosiam", timm_parity.timm_model(agreement.CFG, sd), agreement.B, lr=0.05,
                       lr_predictor=0.05)
  state, trace = agreement.run(ad, ref, agreement.stream(6))
  np.testing.assert_allclose([t["loss"] for t in trace], ref.losses, rtol=1e-5)
  assert trace[0]["kl"] == 0.0 and min(t["kl"] for t in trace[1:]) > 1e-6  # the KL term acts after step 1
  predictor = lambda params: {"predictor.weight": np.asarray(params[PREDICTOR]["kernel"]).T}
  worst, worst_update = agreement.compare(ad, state, ref, predictor)
  print(f"zerosiam: losses {[round(t['loss'], 4) for t in trace]}; adapted params max rel diff {worst:.2e}; "
        f"updates max rel diff {worst_update:.2e}")
