"""ROID and CMF: each piece against a numpy transcription of DT's code, padding, and PyTorch agreement.

The agreement tests run `benchmarks/torch_methods/roid.py` / `cmf.py` (DT's code on timm) and the JAX
method on the same weights, batches (a ragged last one) and augmented views (drawn once by
`ROIDBase.augment`, fed to both), on a stream where ROID's mask keeps some samples and drops others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods import cmf as cmf_lib
from pcsr_jax.methods import roid as roid_lib
from pcsr_jax.models import ViTConfig, create
from tiny import batches, tiny_model

B = 8
torch_only = pytest.mark.torch


def np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_min_max(x):
  return (x - x.min()) / (x.max() - x.min())


def random_logits(seed, n=12, c=10, scale=3.0):
  return np.random.default_rng(seed).standard_normal((n, c)).astype(np.float32) * scale


# ----------------------------------------------------------------------------- losses, weights, prior

def test_soft_likelihood_ratio_matches_numpy():
  logits = random_logits(0)
  logits[0, 3] = 12.0  # p > 0.99: the clamp acts
  p = np.minimum(np_softmax(logits.astype(np.float64)), 0.99)
  assert (p == 0.99).any()
  want = -(p * np.log(p / (1 - p) + 1e-5)).sum(1)
  np.testing.assert_allclose(roid_lib.soft_likelihood_ratio(jnp.asarray(logits)), want, rtol=1e-5, atol=1e-5)
  # torch.clamp passes no gradient above the bound: row 0's loss depends on the others' logits only.
  g = jax.grad(lambda z: roid_lib.soft_likelihood_ratio(z)[0])(jnp.asarray(logits))
  assert np.all(np.isfinite(g)) and np.abs(g[0]).max() > 0


def test_symmetric_cross_entropy_matches_numpy():
  x, e = random_logits(1).astype(np.float64), random_logits(2).astype(np.float64)
  lx, le = np.log(np_softmax(x)), np.log(np_softmax(e))
  want = -0.5 * (np.exp(le) * lx).sum(1) - 0.5 * (np.exp(lx) * le).sum(1)
  got = roid_lib.symmetric_cross_entropy(jnp.asarray(x, jnp.float32), jnp.asarray(e, jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def np_weights(logits, probs_ema, temperature=1 / 3):
  """DT roid.py ``loss_calculation``'s weights on the (unpadded) batch, in float64."""
  p = np_softmax(logits.astype(np.float64))
  cos = p @ probs_ema / (np.linalg.norm(p, axis=1) * np.linalg.norm(probs_ema))
  w_div = np_min_max(1 - cos)
  mask = w_div < w_div.mean()
  w_cert = np_min_max((p * np.log(p)).sum(1))
  w = np.exp(w_div * w_cert / temperature)
  w[mask] = 0
  return w, ~mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_weights_match_numpy_and_ignore_padding(seed):
  n, pad = 9, 3
  logits = random_logits(seed, n + pad)
  logits[n:] = 50.0 * random_logits(seed + 10, pad)  # padding rows with extreme values must change nothing
  ema = np_softmax(np.random.default_rng(seed).standard_normal(10))
  valid = np.arange(n + pad) < n
  w, keep = roid_lib.sample_weights(jnp.asarray(logits), jnp.asarray(ema, jnp.float32), jnp.asarray(valid), 1 / 3)
  want_w, want_keep = np_weights(logits[:n], ema)
  np.testing.assert_array_equal(np.asarray(keep)[:n], want_keep)
  assert not np.asarray(keep)[n:].any() and np.all(np.asarray(w)[n:] == 0)
  assert 0 < want_keep.sum() < n  # the mask keeps some and drops some
  np.testing.assert_allclose(np.asarray(w)[:n], want_w, rtol=1e-5)


def test_equal_weights_are_not_nan():
  """One valid sample: the official's min-max divides 0 by 0; here the sample is kept with weight 1."""
  logits = random_logits(3, 4)
  w, keep = roid_lib.sample_weights(jnp.asarray(logits), jnp.full((10,), 0.1), jnp.array([True, False, False, False]),
                                    1 / 3)
  np.testing.assert_array_equal(keep, [True, False, False, False])
  np.testing.assert_array_equal(w, [1.0, 0.0, 0.0, 0.0])


def test_prior_correction_matches_numpy():
  n, pad = 6, 2
  logits = random_logits(4, n + pad)
  valid = np.arange(n + pad) < n
  got = roid_lib.prior_correction(jnp.asarray(logits), jnp.asarray(valid))
  x = logits[:n].astype(np.float64)
  prior = np_softmax(x).mean(0)
  smooth = max(1 / n, 1 / 10) / prior.max()
  want = x * (prior + smooth) / (1 + smooth * 10)
  np.testing.assert_allclose(np.asarray(got)[:n], want, rtol=1e-5, atol=1e-6)


def test_optax_nesterov_is_torch_nesterov():
  """torch SGD(nesterov): buf = m buf + g (buf = g at first); p -= lr (g + m buf)."""
  rng = np.random.default_rng(0)
  lr, m = 0.1, 0.9
  tx = optax.sgd(lr, momentum=m, nesterov=True)
  p = jnp.asarray(rng.standard_normal(5), jnp.float32)
  st = tx.init(p)
  p_np, buf = np.asarray(p, np.float64), None
  for _ in range(4):
    g = rng.standard_normal(5)
    u, st = tx.update(jnp.asarray(g, jnp.float32), st, p)
    p = optax.apply_updates(p, u)
    buf = g if buf is None else m * buf + g
    p_np = p_np - lr * (g + m * buf)
  np.testing.assert_allclose(p, p_np, rtol=1e-5)


# ----------------------------------------------------------------------------- steps on a tiny model

def tiny_adapter(method, batch_size=B):
  model, params = tiny_model()
  return engine.Adapter(method, model, params, batch_size=batch_size)


def adapt_once(ad, x, views):
  state = ad.init_state()
  valid = jnp.ones(len(x), bool)
  step = jax.jit(lambda st, x, v: ad.method.adapt(ad.prep, ad.frozen, st, x, valid, v))
  return step(state, jnp.asarray(x), jnp.asarray(views))


def draw_views(key, x):
  return np.asarray(jax.jit(methods.get("roid").augment)(key, jnp.asarray(x)))


@pytest.mark.slow
def test_roid_ensembles_with_the_source():
  x = batches(1, B, seed=3)[0]
  views = draw_views(jax.random.key(1), x)
  ens, _, _ = adapt_once(tiny_adapter(methods.get("roid", lr=0.05)), x, views)
  plain, _, m = adapt_once(tiny_adapter(methods.get("roid", lr=0.05, momentum_src=1.0)), x, views)
  src = ens.extra.source
  diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), plain.trainable, src)
  assert max(jax.tree.leaves(diff)) > 1e-4 and 0 < int(m["num_kept"]) < B
  want = jax.tree.map(lambda p, s: 0.99 * p + 0.01 * s, plain.trainable, src)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ens.trainable, want)


@pytest.mark.slow
def test_first_step_is_nesterov_sgd_on_the_undetached_loss():
  """First step (no ensembling): ``-lr (1 + m) grad`` of the loss written out here, with the original logits
  NOT detached in the symmetric CE (the official); detaching them gives a clearly different update."""
  lr = 0.05
  ad = tiny_adapter(methods.get("roid", lr=lr, momentum_src=1.0))
  x = batches(1, B, seed=4)[0]
  views = draw_views(jax.random.key(2), x)
  new, _, metrics = adapt_once(ad, x, views)
  state = ad.init_state()
  valid = jnp.ones(B, bool)
  forward = lambda t, imgs: ad.method.forward(ad.prep, ad.frozen, t, jnp.asarray(imgs))[0]
  weights, keep = roid_lib.sample_weights(forward(state.trainable, x), state.extra.probs_ema, valid, 1 / 3)
  assert 0 < int(keep.sum()) == int(metrics["num_kept"]) < B

  def loss(t, detach):
    out = forward(t, x)
    target = jax.lax.stop_gradient(out) if detach else out
    per_sample = roid_lib.soft_likelihood_ratio(out) + roid_lib.symmetric_cross_entropy(forward(t, views), target)
    return jnp.sum(jnp.where(keep, per_sample * weights, 0.0)) / B

  def update(detach):
    g = jax.jit(jax.grad(loss), static_argnums=1)(state.trainable, detach)
    return np.concatenate([np.ravel(-lr * 1.9 * v) for v in jax.tree.leaves(g)])

  got = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree.leaves(new.trainable),
                                                        jax.tree.leaves(state.trainable))])
  np.testing.assert_allclose(got, update(False), rtol=1e-4, atol=1e-7)
  assert np.abs(update(True) - update(False)).max() > 0.05 * np.abs(got).max()


def np_cmf(source, moves, q, alpha=0.99, gamma=0.99):
  """DT cmf.py: per step, the SGD step (here a given move of the target) then ``bayesian_filtering``, with
  the variance and gain as Python floats; float64 arrays. Returns (target, hidden, var, beta) per step."""
  target, hidden, var, out = source.copy(), source.copy(), 0.0, []
  for move in moves:
    target = target + move
    hidden = alpha * hidden + (1 - alpha) * source  # predict
    var = alpha**2 * var + q
    beta = (1 - q) / (var + 1 - q)
    beta = beta if beta > 0.89 else 0.89
    beta = beta if beta < 0.9999 else 1.0
    var = beta * var
    if beta < 1.0:  # ema_update_model skips momentum 1
      hidden = beta * hidden + (1 - beta) * target
    target = gamma * target + (1 - gamma) * hidden
    out.append((target, hidden, var, beta))
  return out


# q per #trainable = 64 of the test tree: beta in (0.89, 0.9999); clipped to 0.89 from step 2; 1, then below.
@pytest.mark.parametrize("q_eff, regime", [(0.005, "mid"), (0.09, "clip"), (2e-5, "one-then-mid")])
def test_cmf_filter_matches_numpy(q_eff, regime):
  """`CMF.merge` over 8 steps on a tree of 64 params, the SGD step replaced by random moves of the target."""
  rng = np.random.default_rng(0)
  source = rng.standard_normal(64)
  moves = [rng.standard_normal(64) * 0.1 for _ in range(8)]
  method = methods.get("cmf", q=q_eff * cmf_lib.PARAMS_REFERENCE / 64)
  tree = lambda v: {"a": jnp.asarray(v[:40], jnp.float32), "b": {"c": jnp.asarray(v[40:], jnp.float32)}}
  flat = lambda t: np.concatenate([np.asarray(t["a"]), np.asarray(t["b"]["c"])])
  extra = cmf_lib.CMFState(probs_ema=jnp.zeros(3), source=tree(source), hidden=tree(source),
                           var=jnp.zeros((), jnp.float32))
  trainable = tree(source)
  want = np_cmf(source, moves, q_eff)
  betas = []
  for move, (w_target, w_hidden, w_var, w_beta) in zip(moves, want):
    trainable = jax.tree.map(lambda p, d: p + d, trainable, tree(move))
    extra, trainable, metrics = method.merge(extra, trainable)
    np.testing.assert_allclose(float(metrics["beta"]), w_beta, rtol=1e-6)
    np.testing.assert_allclose(float(extra.var), w_var, rtol=1e-5)
    np.testing.assert_allclose(flat(extra.hidden), w_hidden, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(trainable), w_target, rtol=1e-5, atol=1e-6)
    betas.append(w_beta)
  if regime == "mid":
    assert all(0.89 < b < 0.9999 for b in betas), betas
  elif regime == "clip":
    assert betas[0] > 0.89 and all(b == 0.89 for b in betas[1:]), betas
  else:  # the variance grows towards q / (1 - alpha^2) until the gain leaves 1
    assert betas[0] == 1.0 and 0.89 < betas[-1] < 0.9999, betas


@pytest.mark.slow
def test_consistency_chunks_give_the_full_batch_step():
  """The consistency pass over the kept rows in chunks (4 chunks of 2 rows, 3 of 3 with a padded last one, 8
  of 1) gives the step of one pass over the whole batch (1 chunk); each keeps some rows and drops others."""
  x = batches(1, B, seed=3)[0]
  views = draw_views(jax.random.key(4), x)
  runs = {c: adapt_once(tiny_adapter(methods.get("roid", lr=0.05, consistency_chunks=c)), x, views)
          for c in (1, 4, 3, 8)}
  ref, ref_logits, ref_metrics = runs[1]
  assert 0 < int(ref_metrics["num_kept"]) < B
  for c, (state, logits, metrics) in runs.items():
    np.testing.assert_array_equal(logits, ref_logits)  # the loss forward is the same program
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6, err_msg=str(c))
    for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(ref.trainable)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(c))  # float sums in another order
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree.leaves(ref.trainable), jax.tree.leaves(tiny_adapter(methods.get("roid")).init_state().trainable)))
  assert moved > 1e-4  # the step moved the params, so equal params say something


@pytest.mark.parametrize("keep", [True, False])
def test_cmf_reset_between_domains_keeps_the_filter_variance_as_dt(keep):
  """DT's ``reset()`` reloads the models, the optimizer and the class-probability EMA but not ``hidden_var``:
  `Adapter.reset` (the harness's reset per domain) gives the source state with the last domain's ``var``;
  ``keep_var_on_reset=False`` gives the source state whole."""
  ad = tiny_adapter(methods.get("cmf", lr=0.05, use_consistency=False, keep_var_on_reset=keep))
  state = ad.reset()
  for x in batches(2, B, seed=3):
    state, _, _ = ad.step(state, x)
  var = float(state.extra.var)
  assert var > 0
  new, fresh = ad.reset(state), ad.init_state()
  assert float(new.extra.var) == (var if keep else 0.0)
  for a, b in zip(jax.tree.leaves(new.replace(extra=new.extra.replace(var=fresh.extra.var), rng=None)),
                  jax.tree.leaves(fresh.replace(rng=None))):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(jax.random.key_data(new.rng), jax.random.key_data(fresh.rng))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["roid", "cmf"])
def test_ragged_batch_equals_the_unpadded_step(name):
  """The engine's padded ragged batch gives the same params, EMA and logits as the step on the 5 rows alone
  (the loss divisor is the configured batch size either way, as the official's ``cfg.TEST.BATCH_SIZE``)."""
  # (CMF without the augmentation, a faster compile: ROID covers it; q such that the gain is not 1)
  method = methods.get(name, lr=0.05, q=50.0, use_consistency=False) if name == "cmf" else methods.get(name, lr=0.05)
  ad = tiny_adapter(method)
  xs = batches(2, B, seed=5, last=5)
  state = ad.init_state()
  state, _, _ = ad.step(state, xs[0])
  ref_state = jax.tree.map(jnp.array, state)
  padded, logits, metrics = ad.step(state, xs[1])
  direct, d_logits, d_metrics = jax.jit(lambda s, x: method.update(ad.prep, ad.frozen, s, x, jnp.ones(5, bool)))(
      ref_state, jnp.asarray(xs[1]))
  assert 0 < int(metrics["num_kept"]) == int(d_metrics["num_kept"]) < 5 and ad.num_traces == 1
  np.testing.assert_allclose(np.asarray(logits)[:5], d_logits, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves((padded.trainable, padded.extra)), jax.tree.leaves((direct.trainable,
                                                                                      direct.extra))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_reported_logits_are_the_prior_corrected_loss_forward():
  kw = dict(use_consistency=False)  # (no augmentation: a faster compile; it does not touch the prediction)
  ad, off = tiny_adapter(methods.get("roid", **kw)), tiny_adapter(methods.get("roid", use_prior_correction=False, **kw))
  x = batches(1, B, seed=7)[0]
  _, corrected, _ = ad.step(ad.init_state(), x)
  _, raw, _ = off.step(off.init_state(), x)
  np.testing.assert_allclose(raw, ad.method.forward(ad.prep, ad.frozen, ad.init_state().trainable, x)[0],
                             rtol=1e-5, atol=1e-5)
  want = roid_lib.prior_correction(raw, jnp.ones(B, bool))
  np.testing.assert_allclose(corrected, want, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(want) - np.asarray(raw)).max() > 1e-3


@pytest.mark.parametrize("name, kw", [("roid", dict(lr=0.0)), ("roid", dict(momentum=0.0)),
                                      ("roid", dict(temperature=0.0)), ("roid", dict(std=(0.5, 0.5))),
                                      ("roid", dict(momentum_src=1.5)), ("roid", dict(consistency_chunks=0)),
                                      ("cmf", dict(q=-1.0)),
                                      ("cmf", dict(alpha=-0.1))])
def test_bad_hyperparameters(name, kw):
  with pytest.raises(UserError, match=name):
    methods.get(name, **kw)


def test_after_is_refused():
  model, params = tiny_model()
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("cmf"), model, params, batch_size=B, eval_order="after")


# ----------------------------------------------------------------------------- PyTorch agreement

CFG = ViTConfig(embed_dim=48, depth=4, num_heads=3, patch_size=8, img_size=32, num_classes=10)
STEPS = 6  # the last batch ragged (5 of 8)

CASES = {
    "roid": ("roid", {}),
    "roid-lr": ("roid", dict(lr=0.01)),
    "cmf": ("cmf", dict(lr=0.01)),  # q = 0.005 * 864 / 38400: beta just under 0.9999
    "cmf-clip": ("cmf", dict(lr=0.01, q=4.0)),  # q_eff = 0.09: beta 0.91, then clipped to 0.89
}


@pytest.fixture(scope="module")
def torch_setup():
  from pcsr_jax import timm_parity

  model, sd = timm_parity.random_model(CFG)
  rng = np.random.default_rng(1)
  xs = [rng.standard_normal((B if i < STEPS - 1 else 5, 32, 32, 3)).astype(np.float32) for i in range(STEPS)]
  return sd, xs


@torch_only
@pytest.mark.parametrize("case", list(CASES))
def test_jax_and_pytorch_agree(case, torch_setup):
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd, xs = torch_setup
  name, kw = CASES[case]
  method = methods.get(name, **kw)
  ad = engine.Adapter(method, create(CFG), weights.timm_to_flax(sd, CFG), batch_size=B)
  # The views: one ROID draw per step on the padded batch, fed to both sides (torch takes the kept rows).
  padded = [ad.pad(x) for x in xs]
  views = [draw_views(jax.random.key(100 + i), x) for i, (x, _) in enumerate(padded)]
  ref = make_reference(name, timm_parity.timm_model(CFG, sd), B, views=[v[:len(x)].transpose(0, 3, 1, 2) for v, x in zip(views, xs)],
                       **kw)
  step = jax.jit(lambda st, x, valid, v: method.adapt(ad.prep, ad.frozen, st, x, valid, v))
  state, kept = ad.init_state(), []
  for (x, valid), v, raw in zip(padded, views, xs):
    state, logits, metrics = step(state, jnp.asarray(x), jnp.asarray(valid), jnp.asarray(v))
    t_logits = ref.step(torch.from_numpy(raw.transpose(0, 3, 1, 2))).numpy()
    n = len(raw)
    float_checks.assert_predictions_match(t_logits.argmax(-1), np.asarray(logits)[:n])
    np.testing.assert_allclose(np.asarray(logits)[:n], t_logits, atol=1e-4, rtol=1e-4)
    kept.append(int(metrics["num_kept"]))
  assert kept == ref.kept and all(0 < k < len(x) for k, x in zip(kept, xs)), (kept, ref.kept)
  if name == "cmf":
    np.testing.assert_allclose(float(metrics["beta"]), ref.betas[-1], rtol=1e-6)
  src = {k: v for k, v in weights.flax_to_timm(ad.prep.params).items() if k in ref.adapted_state()}
  js = {k: v for k, v in weights.flax_to_timm(ad.params(state)).items() if k in ref.adapted_state()}
  assert len(js) == 2 * (2 * CFG.depth + 1)  # every LayerNorm's weight and bias
  worst, worst_update, excess = float_checks.compare_updates(js, src, ref.adapted_state())
  print(f"{case}: kept per step {kept} of {[len(x) for x in xs]}; betas {getattr(ref, 'betas', [])}; "
        f"adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4 and excess <= 0, (worst, worst_update, excess)
