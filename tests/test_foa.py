"""FOA: prompts in the ViT, the fitness, the pycma-default CMA-ES, determinism/resume, torch agreement."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.cmaes import CMAES
from pcsr_jax.methods.base import split
from pcsr_jax.models import ViTConfig, create
from tests.tiny import TINY, batches, tiny_model


def _source_stats(method, model, params, seed=7):
  prep = method.prepare(model, params, jax.random.key(0), 8)
  frozen, trainable = split(prep.params, prep.is_trainable)
  return method.compute_source_stats(prep, frozen, trainable, iter([(b, None) for b in batches(3, 8, seed=seed)]))


def test_prompts_none_path_and_cls_features():
  model, params = tiny_model()
  x = batches(1, 4)[0]
  v = {"params": params}
  plain = model.apply(v, x)
  np.testing.assert_array_equal(model.apply(v, x, prompts=None), plain)
  logits, cls = model.apply(v, x, return_cls=True)
  np.testing.assert_array_equal(logits, plain)
  assert cls.shape == (4, TINY.depth, TINY.embed_dim)
  np.testing.assert_allclose(model.apply(v, cls[:, -1], method=model.classify), plain, rtol=1e-6, atol=1e-6)
  # Layer 0's feature is block 0's class token normalised by block 1's norm1.
  _, feats = model.apply(v, x, return_features=True)
  t = np.asarray(feats[0][:, 0], np.float64)
  t = (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-6)
  t = t * params["blocks_1"]["norm1"]["scale"] + params["blocks_1"]["norm1"]["bias"]
  np.testing.assert_allclose(cls[:, 0], t, rtol=1e-4, atol=1e-4)


def test_prompts_vmapped_match_loop_and_change_the_output():
  model, params = tiny_model()
  x = batches(1, 4)[0]
  v = {"params": params}
  prompts = jax.random.normal(jax.random.key(1), (5, 3, TINY.embed_dim))
  f = lambda p: model.apply(v, x, prompts=p, return_cls=True)
  vl, vc = jax.vmap(f)(prompts)
  for i in range(5):
    l, c = f(prompts[i])
    np.testing.assert_allclose(vl[i], l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vc[i], c, rtol=1e-5, atol=1e-5)
  assert np.abs(vl[0] - vl[1]).max() > 1e-3 and np.abs(vl[0] - model.apply(v, x)).max() > 1e-3
  _, feats = model.apply(v, x, prompts=prompts[0], return_features=True)
  assert feats[0].shape[1] == 1 + 3 + TINY.num_patches


def test_fitness_matches_numpy_and_ignores_padding():
  model, params = tiny_model()
  m = methods.get("foa")
  stats = _source_stats(m, model, params)
  ad = engine.Adapter(m, model, params, batch_size=8, source_stats=stats)
  x, valid = ad.pad(batches(1, 8, last=None)[0][:6])
  prompts = jax.random.normal(jax.random.key(2), (3, TINY.embed_dim)) * 0.3
  shift = jax.random.normal(jax.random.key(3), (TINY.embed_dim,))
  fit, logits, mean = m.evaluate(ad.prep, ad.frozen, x, valid, prompts, shift)
  _, cls = model.apply({"params": params}, x[:6], prompts=prompts, return_cls=True)
  f = np.asarray(cls, np.float64).reshape(6, -1)
  raw = np.asarray(model.apply({"params": params}, jnp.asarray(cls[:, -1]), method=model.classify), np.float64)
  p = np.exp(raw - raw.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  ent = -(p * np.log(p)).sum()
  want = ent + 0.4 * (np.sum((f.std(0, ddof=1) - stats["std"])**2) + np.sum((f.mean(0) - stats["mean"])**2)) * 6 / 64
  np.testing.assert_allclose(float(fit), want, rtol=1e-5)
  np.testing.assert_allclose(mean, f.mean(0)[-TINY.embed_dim:], rtol=1e-5, atol=1e-6)
  shifted = model.apply({"params": params}, cls[:, -1] + shift, method=model.classify)
  np.testing.assert_allclose(logits[:6], shifted, rtol=1e-5, atol=1e-5)


def _run(ad, xs, state=None):
  state = ad.init_state() if state is None else state
  out = []
  for x in xs:
    state, logits, _ = ad.step(state, x)
    out.append(np.asarray(logits)[:len(x)])
  return state, out


def test_deterministic_and_resumes_bit_identically():
  model, params = tiny_model()
  m = methods.get("foa", chunk=7)
  stats = _source_stats(m, model, params)
  xs = batches(4, 8, last=5)
  mk = lambda: engine.Adapter(m, model, params, batch_size=8, source_stats=stats)
  ad = mk()
  s1, out1 = _run(ad, xs)
  _, out2 = _run(mk(), xs)
  for a, b in zip(out1, out2):
    np.testing.assert_array_equal(a, b)
  mid, _ = _run(ad, xs[:2])
  host = ad.state_to_host(mid)
  ad2 = mk()
  s3, out3 = _run(ad2, xs[2:], ad2.state_from_host(host))
  for a, b in zip(out1[2:], out3):
    np.testing.assert_array_equal(a, b)
  jax.tree.map(np.testing.assert_array_equal, ad.state_to_host(s1).extra, ad2.state_to_host(s3).extra)
  assert float(s1.extra.es.sigma) != 1.0 and not np.allclose(s1.extra.es.mean, 0)


def _pycma(n, popsize):
  import cma  # the convert extra (with torch): the tests using it are marked torch
  es = cma.CMAEvolutionStrategy(n * [0], 1, inopts={"seed": 2020, "popsize": popsize, "maxiter": -1,
                                                    "verbose": -9})
  return es


@pytest.mark.torch
def test_cmaes_constants_match_pycma():
  es = _pycma(2304, 27)
  x = es.ask()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    es.tell(x + [np.zeros(2304)], list(np.arange(28.0)))
  ours = CMAES(2304, 27)
  np.testing.assert_allclose(ours.weights_for(28), np.asarray(es.sp.weights(28)), rtol=1e-12)
  for k, v in [("mueff", es.sp.weights.mueff), ("c1", es.sp.c1), ("cmu", es.sp.cmu), ("cc", es.sp.cc),
               ("cs", es.adapt_sigma.cs), ("damps", es.adapt_sigma.damps), ("lazy_gap", es.sm.lazy_update_gap)]:
    np.testing.assert_allclose(getattr(ours, k), v, rtol=1e-12, err_msg=k)


@pytest.mark.torch
def test_cmaes_update_matches_pycma_on_its_samples():
  """pycma and ours told the same 27 samples + one foreign solution (repaired when far) for 6 generations."""
  n, lam = 40, 27
  es = _pycma(n, lam)
  ours = CMAES(n, lam)
  s = ours.init(jnp.zeros(n))
  rng = np.random.default_rng(0)
  target = rng.standard_normal(n)
  repaired = 0
  for g in range(6):
    x = es.ask()
    # our ask decomposes on the same schedule; its samples are not used here
    _, s = ours.ask(jax.random.key(g), s)
    np.testing.assert_allclose(np.abs(s.D), np.sort(es.sm.D), rtol=2e-4)
    far = g % 2 == 0
    extra = np.asarray(es.mean) + (8.0 if far else 0.3) * es.sigma * rng.standard_normal(n)
    repaired += far
    sols = x + [extra.copy()]
    f = [float(np.sum((v - target)**2)) for v in sols]
    f[-1] = min(f) - 1.0 if g % 3 == 0 else f[-1]  # sometimes the foreign solution is the best
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      es.tell(sols, f)
    s = ours.tell(s, jnp.asarray(np.stack(sols), jnp.float32), jnp.asarray(f, jnp.float32),
                  jnp.arange(lam + 1) < lam)
    np.testing.assert_allclose(s.mean, es.mean, rtol=1e-4, atol=1e-5 * es.sigma)
    np.testing.assert_allclose(float(s.sigma), es.sigma, rtol=1e-6)
    np.testing.assert_allclose(s.C, es.sm.C, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s.ps, es.adapt_sigma.ps, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s.pc, es.pc, rtol=1e-4, atol=1e-5)
  assert repaired == 3


@pytest.mark.torch
def test_agrees_with_torch_reference_on_its_samples():
  """The official step (timm + prompts + pycma) and ours, given pycma's 27 samples per batch: same 28 fitnesses,
  best candidate, reported (shifted) logits, activation-shift EMA and CMA-ES state, over a ragged stream."""
  from benchmarks.torch_methods.foa import Reference
  from pcsr_jax import timm_parity, weights

  cfg = ViTConfig(embed_dim=48, depth=12, num_heads=3, patch_size=8, img_size=32, num_classes=10)
  tm = timm_parity.timm_model(cfg)
  timm_parity.randomize_(tm, seed=0, scale=0.15)
  params = weights.timm_to_flax({k: v.numpy() for k, v in tm.state_dict().items()}, cfg)
  model = create(cfg)
  m = methods.get("foa")
  src = batches(2, 16, cfg, seed=11)
  ad = engine.Adapter(m, model, params, batch_size=16, source_stats={"mean": np.zeros(1), "std": np.zeros(1)})
  frozen, trainable = split(ad.prep.params, ad.prep.is_trainable)
  stats = m.compute_source_stats(ad.prep, frozen, trainable, iter([(b, None) for b in src]))
  ad = engine.Adapter(m, model, params, batch_size=16, source_stats=stats)
  init = np.asarray(m.initial_prompts(model))
  ref = Reference(tm, 16, source_batches=[agreement.nchw(b) for b in src], initial_prompts=init)
  np.testing.assert_allclose(stats["mean"], ref.train_info[1].numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(stats["std"], ref.train_info[0].numpy(), rtol=1e-4, atol=1e-5)

  adapt = jax.jit(lambda fz, c, st, x, v, smp: m.adapt(ad.prep.__class__(**{**ad.prep.__dict__, "consts": c}),
                                                       fz, st, x, v, smp))
  state = ad.init_state()
  bests = []
  for i, x in enumerate(batches(5, 16, cfg, seed=3, last=10)):
    want = ref.step(agreement.nchw(x)).numpy()
    xp, valid = ad.pad(x)
    state, logits, _, fit = adapt(ad.frozen, ad.consts, state, xp, valid, jnp.asarray(ref.candidates[:27], jnp.float32))
    fit = np.asarray(fit)
    np.testing.assert_allclose(fit, ref.fitness, rtol=1e-4, atol=1e-4)
    assert int(np.argmin(fit)) == ref.best_index
    bests.append(ref.best_index)
    np.testing.assert_allclose(np.asarray(logits)[:len(x)], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state.extra.hist, ref.hist_stat.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.extra.es.mean, ref.es.mean, rtol=1e-4, atol=1e-4 * ref.es.sigma)
    print(f"foa batch {i}: sigma rel diff {float(state.extra.es.sigma) / ref.es.sigma - 1:.2e}, |ps| rel diff "
          f"{np.linalg.norm(state.extra.es.ps) / np.linalg.norm(ref.es.adapt_sigma.ps) - 1:.2e}")
    # Measured: sigma within 3.5e-4, ps within 0.35% once the previous best wins (batch 2 on); see the report.
    np.testing.assert_allclose(float(state.extra.es.sigma), ref.es.sigma, rtol=1e-3)
  print("best candidate per batch:", bests)
  assert len(set(bests)) > 1
