"""IMSE: the SVD reparametrisation (the same network before any update, only S trained), its variance term, its
detection of shifts and its pool of experts; and agreement with the PyTorch reference written from the official
``baek85/IMSE`` code (``benchmarks/torch_methods/imse.py``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import traverse_util

import agreement
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import split
from pcsr_jax.methods.imse import compose, decompose, kl_shift, low_std_mean
from pcsr_jax.models import create
from tiny import batches, tiny_model


def _stats(method, model, params, source):
  prep = method.prepare(model, params, jax.random.key(0), 8)
  frozen, trainable = split(prep.params, prep.is_trainable)
  return prep, method.compute_source_stats(prep, frozen, trainable, iter(source))


def test_decomposition_rebuilds_the_kernels_and_the_logits_and_truncates_the_rank():
  rng = np.random.default_rng(0)
  k = rng.standard_normal((6, 10)).astype(np.float32)  # a Flax kernel [in, out]
  f = decompose(k)
  assert f["svd_u"].shape == (10, 6) and f["svd_s"].shape == (6,) and f["svd_vh"].shape == (6, 6)
  np.testing.assert_allclose(np.asarray(compose(f)), k, atol=1e-5)
  low = (rng.standard_normal((8, 2)) @ rng.standard_normal((2, 5))).astype(np.float32)  # rank 2
  assert decompose(low)["svd_s"].shape == (2,)
  np.testing.assert_allclose(np.asarray(compose(decompose(low))), low, atol=1e-5)

  model, params = tiny_model()
  method = methods.get("imse")
  prep, _ = _stats(method, model, params, [(x, None) for x in batches(2, 8, seed=7)])
  flat = traverse_util.flatten_dict(prep.params)
  assert not any(p[-1] == "kernel" and p[0].startswith("blocks_") for p in flat)  # every block Linear factored
  frozen, trainable = split(prep.params, prep.is_trainable)
  names = [p for p in traverse_util.flatten_dict(trainable)]
  assert len(names) == 4 * model.config.depth and all(p[-1] == "svd_s" for p in names)
  x = batches(1, 8, seed=1)[0]
  src = np.asarray(model.apply({"params": params}, x))
  mine = np.asarray(prep.model.apply({"params": prep.params}, x))
  np.testing.assert_allclose(mine, src, atol=1e-5 * np.abs(src).max())
  assert (mine.argmax(-1) == src.argmax(-1)).all()
  # blocks 9-11 are not trained (svd.py collect_params), on a 12-block model
  prep12 = method.prepare(create(agreement.CFG), weights.timm_to_flax(agreement.random_model(), agreement.CFG),
                          jax.random.key(0), 8)
  blocks = {p[0] for p in traverse_util.flatten_dict(split(prep12.params, prep12.is_trainable)[1])}
  assert blocks == {f"blocks_{i}" for i in range(9)}


def test_the_variance_term_and_the_shift_value():
  std = np.array([0.3, 0.1, 0.5, 0.2], np.float32)
  assert float(low_std_mean(std, 1.0)) == pytest.approx(0.2)  # every std but the largest (k = r - 1)
  assert float(low_std_mean(std, 0.5)) == pytest.approx(0.15)  # k = 2: the stds below the 3rd smallest
  assert float(low_std_mean(std, 0.25)) == pytest.approx(0.1)  # k = 1: below the 2nd smallest
  var, mean = np.array([1.0, 2.0], np.float32), np.array([0.0, 1.0], np.float32)
  assert float(kl_shift(var, mean, var, mean)) == 0.0
  # symmetric KL of N(0, 1) and N(1, 4) per channel, averaged
  want = 0.5 * ((1 + 1) / 4 + (4 + 1) / 1) - 1.0
  got = float(kl_shift(np.array([1.0], np.float32), np.array([0.0], np.float32), np.array([4.0], np.float32),
                       np.array([1.0], np.float32)))
  assert got == pytest.approx(want, rel=1e-6)
  for bad in ({"vm_ratio": 0.0}, {"dynamic_mode": "mean"}, {"max_domains": 1}):
    with pytest.raises(UserError, match=rf"^imse {next(iter(bad))}: expected"):
      methods.get("imse", **bad)


def _domain(rng, steps: int, last: int, shift: float = 0.0, scale: float = 1.0) -> list[np.ndarray]:
  size = agreement.CFG.img_size
  sizes = [agreement.B] * (steps - 1) + [last]
  return [(scale * rng.standard_normal((n, size, size, 3)) + shift).astype(np.float32) for n in sizes]


def test_a_shift_saves_an_expert_and_loads_the_nearest_or_the_mix_with_adam_restarted():
  """On the tiny model: noise, then noise shifted by 2: one detection, the S of the first domain saved as expert
  1, and the loaded S: the nearest entry (top1) or S_0 + sum_i softmax(-d_i) (S_i - S_0) (mix), then one Adam
  step from a fresh state (its count 1; every entry moves by at most lr from the loaded S)."""
  from pcsr_jax.methods.imse import patch_tokens, token_stats

  model, params = tiny_model()
  source = [(0.5 * x, None) for x in batches(2, 8, seed=7)]
  xs = batches(6, 8, seed=2) + [x + 2.0 for x in batches(2, 8, seed=3)]
  lr, temp, loaded = 0.05, 20.0, {}  # a temperature that mixes the two entries
  for mode in ("top1", "mix"):
    method = methods.get("imse", dynamic_mode=mode, dss_k=0.5, lr=lr, temp=temp)
    prep, stats = _stats(method, model, params, source)
    ad = engine.Adapter(method, model, params, batch_size=8, source_stats=stats)
    state = ad.init_state()
    for i, x in enumerate(xs):
      before = jax.tree.map(np.asarray, state.trainable)
      state, _, m = ad.step(state, x)
      assert bool(m["detected"]) == bool(m["selected"]) == (i == 6), (i, float(m["shift"]))
      if i != 6:
        continue
      pool = jax.tree.map(np.asarray, state.extra)
      assert int(m["experts"]) == int(pool.size) == 2 and int(state.opt_state[0].count) == 1
      s0, s1 = (jax.tree.map(lambda p, j=j: p[j], pool.s) for j in (0, 1))
      jax.tree.map(np.testing.assert_array_equal, s1, before)  # the expert saved is the S before the shift
      mean, var = token_stats(prep.model.apply({"params": prep.params}, x, method=patch_tokens), np.ones(8, bool))
      d = np.asarray(kl_shift(pool.var[:2], pool.mean[:2], np.asarray(var)[None], np.asarray(mean)[None]))
      if mode == "top1":
        want = s0 if d[0] < d[1] else s1
      else:
        w = np.exp(-(d - d.min()) / temp) / np.exp(-(d - d.min()) / temp).sum()
        assert 0.05 < w[1] < 0.95, w
        want = jax.tree.map(lambda a, b: a + w[1] * (b - a), s0, s1)
      loaded[mode] = want
      moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.trainable, want)
      assert max(jax.tree.leaves(moved)) <= lr * 1.001, moved
  apart = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), loaded["top1"], loaded["mix"])
  assert max(jax.tree.leaves(apart)) > 2 * lr, apart  # the two modes load different S


# agreement.CFG with 5 blocks (a 12-block step compiles for a minute on 2 cores): the variance term on blocks 2-4,
# S trained in blocks 0-3 and block 4's frozen (``skip_blocks``, the reference's ``skip``) as blocks 9-11 on ViT-B.
CFG5 = dataclasses.replace(agreement.CFG, depth=5)


@pytest.mark.torch
def test_imse_matches_the_official_style_reference():
  """Four domains (noise, noise + 2, [a reset per domain: the official oracle shift], noise, half-scale noise as
  the source), ragged last batches. Every step: identical predictions, logits within 1e-4, the same shift value,
  detection, expert loaded and filter counts; at the end S within 2e-3 of its update's size (the two programs'
  SVDs differ in their last bits, and 12 SAM steps through entropy filters amplify that)."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  rng = np.random.default_rng(4)
  sd = agreement.random_model(head_scale=2.0, cfg=CFG5)
  size = agreement.CFG.img_size
  source = (0.5 * rng.standard_normal((133, size, size, 3))).astype(np.float32)  # 2 batches of 64 + 5 left out
  domains = [_domain(rng, 3, 5), _domain(rng, 3, 8, shift=2.0), _domain(rng, 3, 6), _domain(rng, 3, 8, scale=0.5)]
  hp = dict(dss_k=0.5)
  method = methods.get("imse", skip_blocks=(4,), **hp)
  model = create(CFG5)
  params = weights.timm_to_flax(sd, CFG5)
  _, stats = _stats(method, model, params, [(source[i:i + 8], None) for i in range(0, len(source), 8)])
  ad = engine.Adapter(method, model, params, batch_size=agreement.B, source_stats=stats)
  ref = make_reference("imse", timm_parity.timm_model(CFG5, sd), agreement.B, skip=("blocks.4",),
                       source=agreement.nchw(source), **hp)
  np.testing.assert_allclose(stats["var"], ref.domain_infos[0][0].numpy(), rtol=1e-5)
  np.testing.assert_allclose(stats["mean"], ref.domain_infos[0][1].numpy(), rtol=1e-5, atol=1e-6)

  state, trace, experts, reset_at = ad.init_state(), [], [], 2
  for d, xs in enumerate(domains):
    if d == reset_at:
      state = ad.reset(state)
      ref.reset()
    for x in xs:
      state, logits, m = agreement.step_both(ad, state, ref, x)
      assert abs(float(m["shift"]) - hp["dss_k"]) > 0.1  # no detection decided by float noise
      np.testing.assert_allclose(float(m["shift"]), ref.last_shift, rtol=1e-4, atol=1e-6)
      assert int(m["expert"]) == (-1 if ref.selected is None else ref.selected)
      if ref.selected is not None:
        gap = np.sort(ref.last_values.numpy())
        assert gap[1] - gap[0] > 1e-3 * gap[1]  # no expert chosen by float noise
      experts.append(int(m["expert"]))
      trace.append((int(m["num_reliable"]), int(m["num_reliable2"]), int(m["experts"])))
  print(f"imse: (filter 1, filter 2, experts) per step {trace}; detections {ref.counts['detected']}, "
        f"experts loaded {[e for e in experts if e >= 0]}")
  assert [(a, b) for a, b, _ in trace] == ref.counts["reliable"] and [c for *_, c in trace] == ref.counts["experts"]
  assert ref.counts["detected"] == 2 and 0 in experts and any(e > 0 for e in experts)
  assert any(b < a for a, b, _ in trace) and any(a == 0 for a, _, _ in trace)  # both filters bite, one is empty

  theirs = ref.adapted_state()
  flat = traverse_util.flatten_dict(ad.params(state))
  src = traverse_util.flatten_dict(ad.prep.params)
  worst = 0.0
  for p, v in flat.items():
    if p[-1] != "svd_s":
      continue
    name = f"blocks.{p[0].split('_')[1]}.{p[1]}.{p[2]}.S"
    t, mine, s0 = theirs[name], np.asarray(v), np.asarray(src[p])
    update = np.abs(t - s0).max()
    diff = np.abs(mine - t).max()
    if p in traverse_util.flatten_dict(state.trainable):
      assert update > 0
      worst = max(worst, diff / update)
    else:
      assert diff <= 1e-5 * np.abs(t).max(), (name, diff)
  print(f"imse: S updates max rel diff {worst:.2e}")
  assert worst < 2e-3
