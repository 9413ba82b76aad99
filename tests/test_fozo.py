"""FOZO: the zeroth-order (SPSA) prompt step, its dynamic eps/lr rule, the shift's EMA of the summed sides, the
padding and the resets; and agreement with the PyTorch reference written from the official
``eVI-group-SCU/FOZO`` code (``benchmarks/torch_methods/fozo.py``), both fed the JAX method's own directions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import split
from pcsr_jax.models import create
from tiny import TINY, batches, tiny_model


def _stats(method, model, params, src):
  prep = method.prepare(model, params, jax.random.key(0), 8)
  frozen, trainable = split(prep.params, prep.is_trainable)
  return method.compute_source_stats(prep, frozen, trainable, iter([(b, None) for b in src]))


def _adapter(model, params, src=None, **hp):
  m = methods.get("fozo", **hp)
  src = batches(3, 8, seed=7) if src is None else src
  return engine.Adapter(m, model, params, batch_size=8, source_stats=_stats(m, model, params, src))


def test_forward_only_two_passes_shares_foa_statistics_and_checks_its_hyperparameters():
  model, params = tiny_model()
  m, foa = methods.get("fozo"), methods.get("foa")
  assert m.cost == "2F" and m.eval_orders == ("before",) and m.source_data == "required"
  assert m.stats_key() == foa.stats_key()
  src = batches(3, 8, seed=7)
  for k, v in _stats(m, model, params, src).items():
    np.testing.assert_array_equal(v, _stats(foa, model, params, src)[k])
  ad = _adapter(model, params)
  assert ad.num_trainable == 0
  s = ad.init_state().extra
  assert float(s.eps) == 0.5 and np.isclose(float(s.lr), 0.08) and not bool(s.hist_valid)
  with pytest.raises(UserError, match=r"^fozo: eps_min must be <= eps_max"):
    methods.get("fozo", eps_min=0.6)
  with pytest.raises(UserError, match=r"^fozo: lr_min must be <= lr_max"):
    methods.get("fozo", lr_min=4.0)
  with pytest.raises(UserError, match=r"^fozo n_spsa: expected"):
    methods.get("fozo", n_spsa=0)
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("fozo"), model, params, batch_size=8, eval_order="after",
                   source_stats=_stats(m, model, params, src))


def test_one_step_is_the_spsa_estimate_with_the_new_lr_and_the_summed_sides():
  """Given directions Z (n_spsa = 2): the 4 losses are `evaluate`'s at P +- eps Z_j, the reported logits the
  lowest's, P' = P - lr' / 2 sum_j (l+_j - l-_j) / (2 eps) Z_j with lr' = min(3, 0.7 lr + 0.1) (no rise on the
  first batch), h = the sides' summed last-layer means; a ragged batch's padding rows change nothing."""
  model, params = tiny_model()
  ad = _adapter(model, params, n_spsa=2)
  m = ad.method
  x = batches(1, 8, seed=5)[0][:6]
  xp, valid = ad.pad(x)
  state = ad.init_state()
  p0 = np.asarray(state.extra.prompts)
  _, z = m.perturbations(state.rng, model)
  run = jax.jit(lambda st, xx, v, zz: m.adapt(ad.prep, ad.frozen, st, xx, v, zz))
  new, logits, metrics, losses = run(state, xp, valid, z)
  z = np.asarray(z)
  d = TINY.embed_dim
  no_shift = jnp.zeros(d)
  evaluate = jax.jit(lambda xx, v, c: m.evaluate(ad.prep, ad.frozen, xx, v, c, no_shift))
  want, means = [], []
  for j in range(2):
    for sign in (1.0, -1.0):
      cand = jnp.asarray(p0 + sign * 0.5 * z[j]).reshape(3, d)
      loss, lg, mean = evaluate(xp, valid, cand)
      loss6, _, _ = evaluate(x, np.ones(6, bool), cand)  # the same candidate on the 6 rows alone, no padding
      np.testing.assert_allclose(float(loss), float(loss6), rtol=1e-5)
      want.append((float(loss), np.asarray(lg)))
      means.append(np.asarray(mean))
  np.testing.assert_allclose(losses, [w[0] for w in want], rtol=1e-5)
  best = int(np.argmin([w[0] for w in want]))
  assert int(metrics["best"]) == best
  np.testing.assert_allclose(np.asarray(logits)[:6], want[best][1][:6], rtol=1e-5, atol=1e-5)
  lr = 0.08 * 0.7 + 0.1
  np.testing.assert_allclose(float(new.extra.lr), lr, rtol=1e-6)
  np.testing.assert_allclose(float(new.extra.eps), 0.45, rtol=1e-6)
  g = [(want[2 * j][0] - want[2 * j + 1][0]) / (2 * 0.5) for j in range(2)]
  step = -lr / 2 * (g[0] * z[0] + g[1] * z[1])
  assert np.abs(step).max() > 1e-4  # the estimate moves the prompts
  np.testing.assert_allclose(np.asarray(new.extra.prompts) - p0, step, rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(new.extra.hist, (means[0] + means[2]) / 2 + (means[1] + means[3]) / 2,
                             rtol=1e-5, atol=1e-6)
  # All 4 candidates in one vmapped pass (the GPU default, chunk 0 there): the same step.
  wide = engine.Adapter(methods.get("fozo", n_spsa=2, chunk=4), model, params, batch_size=8, source_stats=ad.consts)
  new4, logits4, _, losses4 = jax.jit(lambda st, xx, v, zz: wide.method.adapt(wide.prep, wide.frozen, st, xx, v, zz))(
      state, xp, valid, jnp.asarray(z))
  np.testing.assert_allclose(losses4, losses, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(logits4)[:6], np.asarray(logits)[:6], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new4.extra.prompts, new.extra.prompts, rtol=1e-5, atol=1e-6)


def _schedule(losses, eps_decay, lr_max, eps=0.5, lr=0.08):
  """Eq. 12 as FOZO.py l. 219-243, in Python floats, from each step's lowest loss."""
  avg, out = None, []
  for cur in losses:
    avg = cur if avg is None else 0.9 * avg + 0.1 * cur
    eps, lr = eps * eps_decay, lr * 0.7
    up = cur > avg * 1.05
    eps, lr = (0.5, 0.1) if up else (eps, min(lr_max, lr + 0.1))
    eps, lr = max(0.2, min(0.5, eps)), max(0.1, min(lr_max, lr))
    out.append((up, eps, lr))
  return out


def test_eps_and_lr_clip_a_loss_jump_restores_them_and_a_reset_starts_over():
  """eps_decay 0.6 (eps 0.3, then the 0.2 floor) and lr_max 0.2 (0.156, then the cap) on batches near the
  source, then shifted ones (the loss jumps: eps back to 0.5, lr to 0.1); the shift applies from the second
  batch; a reset gives the initial state back."""
  model, params = tiny_model()
  ad = _adapter(model, params, eps_decay=0.6, lr_max=0.2)
  base, rng = batches(1, 8, seed=3)[0], np.random.default_rng(0)
  xs = [(base + 0.2 * rng.standard_normal(base.shape)).astype(np.float32) for _ in range(4)]
  xs += [x + 2.0 for x in batches(3, 8, seed=4)]
  state, trace = ad.init_state(), []
  p0, z0 = np.asarray(state.extra.prompts), np.asarray(ad.method.perturbations(state.rng, model)[1][0])
  for i, x in enumerate(xs):
    state, logits, metrics = ad.step(state, x)
    trace.append({k: float(v) for k, v in metrics.items()})
    if i == 0:  # no shift yet: the reported logits are the best candidate's plain prompted head
      cand = p0 + (0.5 if int(metrics["best"]) == 0 else -0.5) * z0
      _, lg, _ = ad.method.evaluate(ad.prep, ad.frozen, x, np.ones(8, bool), jnp.asarray(cand).reshape(3, -1),
                                    jnp.zeros(TINY.embed_dim))
      np.testing.assert_allclose(np.asarray(logits), np.asarray(lg), rtol=1e-5, atol=1e-5)
  want = _schedule([t["loss"] for t in trace], 0.6, 0.2)
  print("fozo schedule (increasing, eps, lr):", [(int(t["increasing"]), round(t["eps"], 3), round(t["lr"], 3))
                                                for t in trace])
  assert [bool(t["increasing"]) for t in trace] == [w[0] for w in want]
  np.testing.assert_allclose([t["eps"] for t in trace], [w[1] for w in want], rtol=1e-5)
  np.testing.assert_allclose([t["lr"] for t in trace], [w[2] for w in want], rtol=1e-5)
  ups = [bool(t["increasing"]) for t in trace]
  assert not any(ups[:4]) and any(ups[4:])
  assert [round(t["eps"], 6) for t in trace[:3]] == [0.3, 0.2, 0.2] and trace[1]["lr"] == pytest.approx(0.2)
  assert {int(t["best"]) for t in trace} == {0, 1}
  fresh = ad.reset(state).extra
  for k, v in vars(ad.init_state().extra).items():
    np.testing.assert_array_equal(getattr(fresh, k), v)


def _domain(steps: int, last: int, seed: int, shift: float, jitter: float = 1.0) -> list[np.ndarray]:
  """A domain's batches (the last ragged): one base batch plus ``jitter`` times fresh noise, plus ``shift``."""
  rng = np.random.default_rng(seed)
  size = agreement.CFG.img_size
  base = rng.standard_normal((agreement.B, size, size, 3))
  sizes = [agreement.B] * (steps - 1) + [last]
  return [(base[:n] + jitter * rng.standard_normal((n, size, size, 3)) + shift).astype(np.float32) for n in sizes]


@pytest.mark.torch
def test_fozo_matches_the_official_style_reference():
  """Three domains, a reset before the second (as ``main.py`` resets per corruption) and none before the third
  (``--continual``), each ending in a ragged batch; n_spsa 2. Both sides get the JAX method's directions. Every
  step: identical predictions, logits within 1e-4, the same 4 losses, best candidate, loss-jump flag, eps, lr
  and shift EMA; the prompts within 1e-3 of their update's size (an SPSA estimate divides a loss difference of
  float32 sums by 2 eps)."""
  from benchmarks.torch_methods.fozo import Reference
  from pcsr_jax import timm_parity, weights

  sd = agreement.random_model(head_scale=1.0)
  cfg = agreement.CFG
  model = create(cfg)
  params = weights.timm_to_flax(sd, cfg)
  hp = dict(n_spsa=2, eps_decay=0.6, lr_max=0.2)  # the clips reached in a few steps
  m = methods.get("fozo", **hp)
  src = _domain(2, 8, seed=11, shift=0.0)
  ad = engine.Adapter(m, model, params, batch_size=agreement.B, source_stats=_stats(m, model, params, src))
  ref = Reference(timm_parity.timm_model(cfg, sd), agreement.B, [agreement.nchw(b) for b in src], **hp,
                  initial_prompts=np.asarray(m.initial_prompts(model)))
  np.testing.assert_allclose(ad.consts["mean"], ref.train_info["combined_stats"][1].numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ad.consts["std"], ref.train_info["combined_stats"][0].numpy(), rtol=1e-4, atol=1e-5)
  domains = [(_domain(4, 5, seed=1, shift=0.0, jitter=0.2), False), (_domain(3, 3, seed=2, shift=0.3), True),
             (_domain(3, 6, seed=3, shift=1.5), False)]
  p_init = np.asarray(m.initial_prompts(model)).reshape(-1)
  state, flags, bests, eps, lrs, resets, worst = ad.init_state(), [], [], [], [], 0, 0.0
  for xs, reset in domains:
    if reset:
      state = ad.reset(state)
      ref.reset()
      resets += 1
    for x in xs:
      ref.directions = np.asarray(m.perturbations(state.rng, model)[1])
      state, logits, metrics = agreement.step_both(ad, state, ref, x)
      assert int(metrics["best"]) == ref.best_index[-1] and bool(metrics["increasing"]) == ref.increasing[-1]
      np.testing.assert_allclose(float(metrics["loss"]), ref.losses.min(), rtol=1e-5)
      np.testing.assert_allclose(float(metrics["avg_loss"]), ref.avg_loss, rtol=1e-5)
      np.testing.assert_allclose(float(metrics["eps"]), ref.zo_eps, rtol=1e-6)
      np.testing.assert_allclose(float(metrics["lr"]), ref.lr, rtol=1e-6)
      np.testing.assert_allclose(state.extra.hist, ref.hist_stat[-cfg.embed_dim:].numpy(), rtol=1e-4, atol=1e-5)
      mine, theirs = np.asarray(state.extra.prompts), ref.adapted_state()["prompts"]
      rel = float(np.abs(mine - theirs).max() / np.abs(theirs - p_init).max())
      assert rel < 1e-3, rel
      worst = max(worst, rel)
      flags.append(int(metrics["increasing"]))
      bests.append(int(metrics["best"]))
      eps.append(round(float(metrics["eps"]), 3))
      lrs.append(round(float(metrics["lr"]), 3))
  print(f"fozo: loss jumps per step {flags}, best candidate {bests}, eps {eps}, lr {lrs}, resets {resets}; prompts "
        f"max rel "
        f"diff to their update {worst:.2e}")
  assert resets == 1 and 0 < sum(flags) < len(flags) and flags[-3:] != [0, 0, 0]  # the third domain's jump
  assert min(eps) == pytest.approx(0.2) and min(lrs) == pytest.approx(0.1) and max(lrs) == pytest.approx(0.2)
  assert len(set(bests)) >= 3  # both sides of both draws win
