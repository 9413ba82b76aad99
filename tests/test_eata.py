"""EATA / ETA: the two filters and the moving average, the Fisher, the gated update, padding, and agreement
with the PyTorch reference written as the official code (benchmarks/torch_methods/eata.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import float_checks
from pcsr_jax import engine, losses, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import merge, split
from pcsr_jax.methods.eata import ProbsAverage, select_samples
from pcsr_jax.models import ViTConfig, create
from test_losses import np_entropy
from tiny import TINY, batches, tiny_model

B = 8


def np_softmax(logits):
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def source_stats(method, model, params, sizes=(B, B, 5), seed=7, cfg=TINY):
  prep = method.prepare(model, params, jax.random.key(0), B)
  frozen, trainable = split(prep.params, prep.is_trainable)
  rng = np.random.default_rng(seed)
  xs = [rng.standard_normal((n, cfg.img_size, cfg.img_size, 3)).astype(np.float32) for n in sizes]
  return method.compute_source_stats(prep, frozen, trainable, iter([(x, -np.ones(len(x), np.int32)) for x in xs])), xs


def test_registry_variants_and_bad_hyperparameters():
  eata, eta = methods.get("eata"), methods.get("eta")
  assert eata.fisher_alpha == 2000.0 and eata.uses_source_data() and eata.source_images == 2000
  assert eta.fisher_alpha == 0.0 and not eta.uses_source_data()
  assert not eata.source_labels and eata.source_data == "optional"
  with pytest.raises(UserError, match="fisher_alpha"):
    methods.get("eata", fisher_alpha=-1.0)
  with pytest.raises(UserError, match="d_margin"):
    methods.get("eta", d_margin=0.0)
  model, params = tiny_model()
  ad = engine.Adapter(eta, model, params, batch_size=B)
  paths = {"/".join(k) for k in traverse_util.flatten_dict(ad.init_state().trainable)}
  assert paths == {f"blocks_{i}/{n}/{p}" for i in range(TINY.depth) for n in ("norm1", "norm2")
                   for p in ("scale", "bias")} | {"norm/scale", "norm/bias"}


def test_select_samples_follows_update_model_probs():
  rng = np.random.default_rng(0)
  probs = np_softmax(3 * rng.standard_normal((6, 5))).astype(np.float32)
  ent = np_entropy(np.log(probs)).astype(np.float32)
  e0 = float(np.median(ent))
  valid = np.array([True] * 5 + [False])
  reliable_np = (ent < e0) & valid
  # No average yet, no reliable sample: nothing kept, still no average.
  none = ProbsAverage.init(5)
  r, k, avg = select_samples(jnp.asarray(probs), jnp.asarray(ent), jnp.zeros(6, bool), none, e0, 0.05)
  assert not np.any(k) and not bool(avg.initialised) and np.all(np.asarray(avg.probs) == 0)
  # No average yet: every reliable sample is kept (no cosine) and the average is their mean softmax.
  r, k, avg = select_samples(jnp.asarray(probs), jnp.asarray(ent), jnp.asarray(valid), none, e0, 0.05)
  np.testing.assert_array_equal(r, reliable_np)
  np.testing.assert_array_equal(k, reliable_np)
  assert bool(avg.initialised) and 0 < reliable_np.sum() < 5
  np.testing.assert_allclose(avg.probs, probs[reliable_np].mean(0), rtol=1e-6)
  # With an average: kept = reliable and |cos| < d0; m <- 0.9 m + 0.1 mean(kept).
  m = probs[0]
  cos = probs @ m / np.linalg.norm(probs, axis=1) / np.linalg.norm(m)
  d0 = float(np.median(cos[reliable_np])) + 1e-3
  kept_np = reliable_np & (np.abs(cos) < d0)
  assert 0 < kept_np.sum() < reliable_np.sum()
  have = ProbsAverage(probs=jnp.asarray(m), initialised=jnp.ones((), bool))
  r, k, avg = select_samples(jnp.asarray(probs), jnp.asarray(ent), jnp.asarray(valid), have, e0, d0)
  np.testing.assert_array_equal(k, kept_np)
  np.testing.assert_allclose(avg.probs, 0.9 * m + 0.1 * probs[kept_np].mean(0), rtol=1e-6)
  # With an average, nothing kept: unchanged.
  r, k, avg = select_samples(jnp.asarray(probs), jnp.asarray(ent), jnp.asarray(valid), have, e0, 1e-9)
  assert not np.any(k) and np.all(np.asarray(avg.probs) == m)


def test_fisher_is_the_mean_over_batches_of_squared_batch_gradients():
  model, params = tiny_model()
  method = methods.get("eata")
  stats, xs = source_stats(method, model, params)  # the last batch (5) is partial: padded and masked
  prep = method.prepare(model, params, jax.random.key(0), B)
  frozen, trainable = split(prep.params, prep.is_trainable)

  def ce(trainable, x):  # the exact batch, no padding
    logits = model.apply({"params": merge(frozen, trainable)}, x)
    return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(len(x)), jnp.argmax(logits, -1)])

  grad = jax.jit(jax.grad(ce))
  direct = [traverse_util.flatten_dict(grad(trainable, x)) for x in xs]
  for k, v in traverse_util.flatten_dict(trainable).items():
    want = sum(np.asarray(g[k], np.float64) ** 2 for g in direct) / len(xs)
    np.testing.assert_allclose(stats["fisher/" + "/".join(k)], want, rtol=2e-5, atol=1e-12)
    np.testing.assert_array_equal(stats["theta0/" + "/".join(k)], v)
  assert max(float(np.max(v)) for k, v in stats.items() if k.startswith("fisher/")) > 0


def run_stream(method, xs, batch_size=B, stats=None):
  """Steps the adapter; returns the state and per step (logits, m before the step, metrics)."""
  model, params = tiny_model()
  ad = engine.Adapter(method, model, params, batch_size=batch_size, source_stats=stats)
  state, trace = ad.init_state(), []
  for x in xs:
    before = (np.asarray(state.extra.probs).copy(), bool(state.extra.initialised))
    state, logits, metrics = ad.step(state, x)
    trace.append((np.asarray(logits)[: len(x)], before, jax.tree.map(np.asarray, metrics)))
  return ad, state, trace


def test_stream_filters_and_moving_average_match_numpy():
  method = methods.get("eta", margin_factor=0.6, d_margin=0.9)
  xs = batches(6, B, seed=3)
  _, state, trace = run_stream(method, xs)
  e0 = 0.6 * np.log(TINY.num_classes)
  m, init = np.zeros(TINY.num_classes), False
  counts = []
  for logits, (m_jax, init_jax), metrics in trace:
    np.testing.assert_allclose(m_jax, m, rtol=1e-5, atol=1e-7)
    assert init_jax == init
    p = np_softmax(logits.astype(np.float64))
    reliable = np_entropy(logits.astype(np.float64)) < e0
    if init:
      kept = reliable & (np.abs(p @ m / np.linalg.norm(p, axis=1) / np.linalg.norm(m)) < 0.9)
      if kept.any():
        m = 0.9 * m + 0.1 * p[kept].mean(0)
    else:
      kept = reliable
      if kept.any():
        m, init = p[kept].mean(0), True
    counts.append((int(metrics["num_reliable"]), int(metrics["num_kept"])))
    assert counts[-1] == (reliable.sum(), kept.sum())
  print("eta tiny stream (reliable, kept):", counts)
  assert any(0 < k < r for r, k in counts) and any(r < B for r, _ in counts)  # both filters bite
  np.testing.assert_allclose(state.extra.probs, m, rtol=1e-5, atol=1e-7)


def test_no_kept_sample_moves_nothing_not_even_momentum():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("eta", margin_factor=0.5), model, params, batch_size=B)
  state = ad.init_state()
  state, _, m1 = ad.step(state, batches(1, B, seed=3)[0])  # some kept: momentum is now non-zero
  assert int(m1["num_kept"]) > 0
  before = jax.tree.map(np.array, (state.trainable, state.opt_state, state.extra))
  ad2 = engine.Adapter(methods.get("eta", margin_factor=0.0), model, params, batch_size=B)  # nothing reliable
  state, _, m2 = ad2.step(state, batches(1, B, seed=4)[0])
  assert int(m2["num_reliable"]) == 0
  after = jax.tree.map(np.array, (state.trainable, state.opt_state, state.extra))
  jax.tree.map(np.testing.assert_array_equal, before, after)


def test_padding_invariance_of_a_ragged_batch():
  model, params = tiny_model()
  method = methods.get("eata", margin_factor=0.6, d_margin=0.9, lr=0.01, fisher_alpha=500.0)
  stats, _ = source_stats(method, model, params)
  xs = [x[:5] for x in batches(3, B, seed=3)]
  _, padded, tp = run_stream(method, xs, batch_size=B, stats=stats)
  _, exact, te = run_stream(method, xs, batch_size=5, stats=stats)
  assert [int(t[2]["num_kept"]) for t in tp] == [int(t[2]["num_kept"]) for t in te]
  assert any(int(t[2]["num_kept"]) for t in tp[1:])  # the Fisher term acts after the first update
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), (padded.trainable,
               padded.extra.probs), (exact.trainable, exact.extra.probs))
  # ... and the default lr is 0.001 * B / 64: a 5-batch adapter's first update is 5/8 of an 8-batch one's
  # (updates ~1e-5; 2e-7 = a few float32 ulps of the params, far below the 3/8 difference).
  lr_default = methods.get("eta", margin_factor=0.6)
  _, s8, _ = run_stream(lr_default, xs[:1], batch_size=B)
  _, s5, _ = run_stream(lr_default, xs[:1], batch_size=5)
  src = traverse_util.flatten_dict(tiny_model()[1])
  for k, v in traverse_util.flatten_dict(s8.trainable).items():
    np.testing.assert_allclose(np.asarray(traverse_util.flatten_dict(s5.trainable)[k]) - src[k],
                               (np.asarray(v) - src[k]) * 5 / 8, rtol=0, atol=2e-7)


# --- agreement with the PyTorch reference -----------------------------------------------------------------

CFG = ViTConfig(embed_dim=48, depth=12, num_heads=3, patch_size=8, img_size=32, num_classes=10)
# E0 = 0.87 ln 10 keeps about half of this random model's samples; its soft predictions all lean to one class,
# so the cosines to the average are 0.7-1: d0 = 0.9 keeps some and drops others (0.05 would drop all).
MARGIN, D0, STEPS = 0.87, 0.9, 8


@pytest.fixture(scope="module")
def torch_setup():
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(CFG)
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((B, 32, 32, 3)).astype(np.float32) for _ in range(STEPS)]
  src = [rng.standard_normal((n, 32, 32, 3)).astype(np.float32) for n in (B, B, 5)]  # the last one partial
  return sd, xs, src


def run_both(name, sd, xs, src, margin=MARGIN, **kw):
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  method = methods.get(name, margin_factor=margin, d_margin=D0, **kw)
  params = weights.timm_to_flax(sd, CFG)
  stats = None
  if method.uses_source_data():
    prep = method.prepare(create(CFG), params, jax.random.key(0), B)
    frozen, trainable = split(prep.params, prep.is_trainable)
    stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, -np.ones(len(x))) for x in src]))
  ad = engine.Adapter(method, create(CFG), params, batch_size=B, source_stats=stats)
  nchw = lambda x: torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  ref_kw = dict(kw, source_batches=[nchw(x) for x in src]) if method.uses_source_data() else dict(kw)
  ref = make_reference(name, timm_parity.timm_model(CFG, sd), B, e_margin=margin * np.log(CFG.num_classes),
                       d_margin=D0, **ref_kw)
  state, trace = ad.init_state(), []
  for x in xs:
    m = np.asarray(state.extra.probs).copy()
    state, logits, metrics = ad.step(state, x)
    t_logits = ref.step(nchw(x)).numpy()
    trace.append(dict(jax=np.asarray(logits), torch=t_logits, m=m,
                      counts=(int(metrics["num_reliable"]), int(metrics["num_kept"])),
                      torch_counts=(ref.num_reliable, ref.num_kept)))
  timm_jax = weights.flax_to_timm(ad.params(state))
  timm_src = weights.flax_to_timm(ad.prep.params)
  ts = ref.adapted_state()
  return trace, {k: timm_jax[k] for k in ts}, {k: timm_src[k] for k in ts}, ts, stats, ref


@pytest.mark.torch
def test_eata_and_eta_agree_with_pytorch(torch_setup):
  sd, xs, src = torch_setup
  e0 = MARGIN * np.log(CFG.num_classes)
  results = {}
  for name in ("eata", "eta"):
    trace, js, jsrc, ts, stats, ref = run_both(name, sd, xs, src)
    for t in trace:
      float_checks.assert_predictions_match(t["torch"].argmax(-1), t["jax"])
      np.testing.assert_allclose(t["jax"], t["torch"], atol=1e-4, rtol=1e-4)
      assert t["counts"] == t["torch_counts"], (t["counts"], t["torch_counts"])
      # No filter decision within float noise: entropies and cosines are clear of E0 and d0.
      p, ent = np_softmax(t["jax"].astype(np.float64)), np_entropy(t["jax"].astype(np.float64))
      assert np.min(np.abs(ent - e0)) > 1e-4
      if np.any(t["m"]):  # only the reliable samples are compared with the average
        cos = p @ t["m"] / np.linalg.norm(p, axis=1) / np.linalg.norm(t["m"])
        assert np.min(np.abs(cos - D0)[ent < e0], initial=1.0) > 1e-4
    counts = [t["counts"] for t in trace]
    print(f"{name}: (reliable, kept) per step {counts}")
    assert any(r < B for r, _ in counts) and any(0 < k < r for r, k in counts[1:])  # both filters bite
    assert any(k == 0 for _, k in counts)  # a step without update (gated, momentum included)
    if name == "eata":  # the Fisher itself, against main.py's loop (timm names through the param map)
      flat = traverse_util.flatten_dict(weights.timm_to_flax(sd, CFG))
      flat.update({tuple(k.split("/")[1:]): v for k, v in stats.items() if k.startswith("fisher/")})
      as_timm = weights.flax_to_timm(traverse_util.unflatten_dict(flat))
      assert sorted(ref.fishers) == sorted(ts)
      for tname, (f, _) in ref.fishers.items():
        np.testing.assert_allclose(as_timm[tname], f.numpy(), rtol=1e-4, atol=1e-10)
    worst, worst_update, excess = float_checks.compare_updates(js, jsrc, ts)
    print(f"{name}: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
    assert worst < 1e-4 and excess <= 0, (worst, excess)
    results[name] = (js, jsrc)
  _, fisher_effect, _ = float_checks.compare_updates(results["eata"][0], results["eata"][1], results["eta"][0])
  print(f"EATA vs ETA: updates max rel diff {fisher_effect:.2e}")
  assert fisher_effect > 1e-2  # the Fisher term matters on this stream


@pytest.mark.torch
def test_come_eata_agrees_with_pytorch(torch_setup):
  """COME's EATA (``eata_come.py``): the filter, weight and loss on COME's entropy (0.07-0.15 on this random
  model: E0 = 0.1), the redundancy check on the softmax; the same counts, logits and updates as the reference
  (at lr 0.05: the default's updates sit at float32's resolution of the params)."""
  sd, xs, src = torch_setup
  margin = 0.0434  # E0 = 0.0434 ln 10 = 0.1
  trace, js, jsrc, ts, _, _ = run_both("eata-come", sd, xs, src, margin=margin, lr=0.05)
  for t in trace:
    float_checks.assert_predictions_match(t["torch"].argmax(-1), t["jax"])
    np.testing.assert_allclose(t["jax"], t["torch"], atol=1e-4, rtol=1e-4)
    assert t["counts"] == t["torch_counts"], (t["counts"], t["torch_counts"])
    ent = np.asarray(losses.come_entropy(jnp.asarray(t["jax"])))
    assert np.min(np.abs(ent - margin * np.log(CFG.num_classes))) > 1e-4  # no decision within float noise
  counts = [t["counts"] for t in trace]
  print(f"eata-come: (reliable, kept) per step {counts}")
  assert any(0 < r < B for r, _ in counts) and any(k > 0 for _, k in counts)
  worst, worst_update, excess = float_checks.compare_updates(js, jsrc, ts)
  print(f"eata-come: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4 and excess <= 0, (worst, excess)
