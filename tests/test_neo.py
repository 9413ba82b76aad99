"""NEO: nothing adapts, the centre is the running mean (or the continual EMA) of the embeddings seen since the last
reset, the head classifies the re-centred embedding; and agreement with the PyTorch reference written from the
official ``awesomealex1/NEO`` code (``benchmarks/torch_methods/neo.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.models.vit import features_and_logits
from tiny import batches, tiny_model


def test_nothing_adapts_one_forward_and_only_the_before_prediction():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("neo"), model, params, batch_size=4)
  assert ad.num_trainable == 0 and methods.get("neo").cost == "1F"
  state = ad.init_state()
  assert int(state.extra.count) == 0 and not np.asarray(state.extra.mean).any()
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("neo"), model, params, batch_size=4, eval_order="after")
  with pytest.raises(UserError, match=r"^neo alpha: expected"):
    methods.get("neo", alpha=1.5)


def _features(model, params, x):
  z, logits = features_and_logits(model, params, x)
  return np.asarray(z, np.float64), np.asarray(logits)


def test_the_centre_is_the_mean_of_every_embedding_seen_and_a_reset_starts_over():
  """A ragged last batch (its padding rows neither in the mean nor in the count), the logits ``head(z - c)``
  with the batch already in c, a reset per domain; and the EMA of the continual variant from c = 0."""
  model, params = tiny_model()
  kernel, bias = np.asarray(params["head"]["kernel"], np.float64), np.asarray(params["head"]["bias"], np.float64)
  xs = batches(3, 8, seed=3, last=5)
  ad = engine.Adapter(methods.get("neo"), model, params, batch_size=8)
  state, seen, changed = ad.init_state(), [], 0
  for x in xs:
    state, logits, metrics = ad.step(state, x)
    z, source_logits = _features(model, params, x)
    seen.append(z)
    c = np.concatenate(seen).mean(0)
    assert int(state.extra.count) == int(metrics["seen"]) == sum(len(s) for s in seen)
    np.testing.assert_allclose(np.asarray(state.extra.mean), c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[:len(x)], (z - c) @ kernel + bias, rtol=1e-4, atol=1e-5)
    changed += int((np.asarray(logits)[:len(x)].argmax(-1) != source_logits.argmax(-1)).sum())
  assert changed > 0  # the re-centring moves predictions off the source head's
  state = ad.reset(state)
  assert int(state.extra.count) == 0 and not np.asarray(state.extra.mean).any()
  state, _, _ = ad.step(state, xs[2])
  np.testing.assert_allclose(np.asarray(state.extra.mean), _features(model, params, xs[2])[0].mean(0), rtol=1e-5,
                             atol=1e-6)

  cont = engine.Adapter(methods.get("neo", alpha=0.1), model, params, batch_size=8)
  state, c = cont.init_state(), 0.0
  for x in xs:
    state, _, _ = cont.step(state, x)
    c = 0.9 * c + 0.1 * _features(model, params, x)[0].mean(0)
  np.testing.assert_allclose(np.asarray(state.extra.mean), c, rtol=1e-5, atol=1e-6)


def _domain(steps: int, last: int, seed: int, shift: float) -> list[np.ndarray]:
  """A domain's batches (the last ragged) whose pixels are shifted by ``shift``: embeddings off the source's."""
  rng = np.random.default_rng(seed)
  sizes = [agreement.B] * (steps - 1) + [last]
  size = agreement.CFG.img_size
  return [(rng.standard_normal((n, size, size, 3)) + shift).astype(np.float32) for n in sizes]


@pytest.mark.torch
def test_neo_matches_the_official_style_reference():
  """Two domains with a reset between them (as ``main.py`` resets per corruption), each ending in a ragged
  batch, for ``neo``; the same stream without a reset for the continual EMA (``neo_cont``, alpha 0.1). Every
  step: identical predictions, logits within 1e-4, the same count, the centre within 1e-5 of its size."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd = agreement.random_model(head_scale=2.0)
  domains = [_domain(4, 5, seed=1, shift=0.5), _domain(3, 3, seed=2, shift=-1.0)]
  for alpha, reset in ((0.0, True), (0.1, False)):
    ad = agreement.adapter("neo", sd, alpha=alpha)
    ref = make_reference("neo", timm_parity.timm_model(agreement.CFG, sd), agreement.B, alpha=alpha)
    state, counts, resets, changed, worst = ad.init_state(), [], 0, 0, 0.0
    for d, xs in enumerate(domains):
      if d and reset:
        state = ad.reset(state)
        ref.reset()
        resets += 1
      for x in xs:
        state, logits, metrics = agreement.step_both(ad, state, ref, x)
        mine, theirs = np.asarray(state.extra.mean), ref.center()
        rel = float(np.abs(mine - theirs).max() / np.abs(theirs).max())
        assert rel < 1e-5, rel
        worst = max(worst, rel)
        if alpha == 0.0:
          assert int(state.extra.count) == ref.adapt_sample_count
        counts.append(int(metrics["seen"]))
        with torch.no_grad():  # the source head on the same embeddings, without the centre
          source = ref.classifier(ref.feature_extractor(agreement.nchw(x))).numpy()
        changed += int((source.argmax(-1) != logits.argmax(-1)).sum())
    print(f"neo alpha {alpha}: samples in the centre per step {counts}, resets {resets}, predictions moved off the "
          f"source head {changed}; centre max rel diff {worst:.2e}")
    assert changed > 0
    if reset:
      assert counts == [8, 16, 24, 29, 8, 16, 19] and resets == 1
