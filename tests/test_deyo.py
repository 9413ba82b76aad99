"""DeYO: the patch shuffle, the adapted set, the gated update when nothing is kept, and agreement with the
PyTorch reference written as the official ``forward_and_adapt_deyo``, fed the same patch permutations."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.deyo import patch_permutations, shuffle_patches
from pcsr_jax.models import create
from test_methods import flat_paths
from tiny import adapted_at_batch_one, batches, tiny_model


def test_shuffle_permutes_patches_per_sample_deterministically():
  b, n, size = 6, 4, 32
  perms = np.asarray(patch_permutations(jax.random.key(3), b, n))
  np.testing.assert_array_equal(perms, np.asarray(patch_permutations(jax.random.key(3), b, n)))
  assert not np.array_equal(perms, np.asarray(patch_permutations(jax.random.key(4), b, n)))
  assert all(sorted(p) == list(range(n * n)) for p in perms)
  assert len({tuple(p) for p in perms}) == b  # each sample its own permutation
  x = np.random.default_rng(0).standard_normal((b, size, size, 3)).astype(np.float32)
  y = np.asarray(shuffle_patches(x, perms, n))
  s = size // n
  patch = lambda img, j: img[(j // n) * s:(j // n + 1) * s, (j % n) * s:(j % n + 1) * s]  # row-major numbering
  for i in range(b):
    for j in range(n * n):  # output patch j is input patch perms[i, j]
      np.testing.assert_array_equal(patch(y[i], j), patch(x[i], perms[i, j]))


def test_deyo_adapts_sars_layernorms_and_checks_hyperparameters():
  model, params = tiny_model()
  deyo = engine.Adapter(methods.get("deyo", skip_blocks=(1,)), model, params, batch_size=4)
  sar = engine.Adapter(methods.get("sar", skip_blocks=(1,)), model, params, batch_size=4)
  assert flat_paths(deyo.init_state().trainable) == flat_paths(sar.init_state().trainable)
  with pytest.raises(UserError, match="patch_len"):
    engine.Adapter(methods.get("deyo", patch_len=5), model, params, batch_size=4)  # 32 is not a multiple of 5
  with pytest.raises(UserError, match="deyo shuffle_chunks"):
    methods.get("deyo", shuffle_chunks=0)


def test_shuffled_forward_chunks_give_the_whole_batch_step():
  """x' of filter 1's rows in chunks (4 of 2 rows, 3 of 3 with a padded last one) gives the step of one chunk
  of the whole batch: same PLPD filter counts, same loss, same params; filter 1 keeps some rows, not all."""
  model, params = tiny_model()
  x = batches(1, 8, seed=2)[0]
  runs = {}
  for c in (1, 4, 3):
    ad = engine.Adapter(methods.get("deyo", skip_blocks=(), ent_factor=0.6, plpd_threshold=-0.05,
                                    shuffle_chunks=c), model, params, batch_size=8)
    state, logits, m = ad.step(ad.init_state(), x)
    runs[c] = (state, np.asarray(logits), {k: float(v) for k, v in m.items()})
  ref, ref_logits, ref_m = runs[1]
  assert 0 < ref_m["num_reliable"] < 8 and 0 < ref_m["num_reliable2"], ref_m
  for c, (state, logits, m) in runs.items():
    np.testing.assert_array_equal(logits, ref_logits)
    assert m["num_reliable2"] == ref_m["num_reliable2"], (c, m)
    np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=1e-6, err_msg=str(c))
    for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(ref.trainable)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(c))


def test_nothing_kept_moves_neither_params_nor_momentum():
  """After a step that adapts (a non-zero momentum buffer), a step whose filters keep nothing leaves params
  and optimizer state bit-identical: the official code returns before optimizer.step()."""
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("deyo", skip_blocks=(), ent_factor=2.0, plpd_threshold=-1.0), model, params,
                      batch_size=8)
  x = batches(2, 8)
  state, _, m = ad.step(ad.init_state(), x[0])
  assert int(m["num_reliable2"]) > 0
  assert any(np.abs(np.asarray(v)).max() > 0 for v in jax.tree.leaves(state.opt_state))
  before = jax.tree.map(np.array, (state.trainable, state.opt_state))
  nothing = np.zeros(8, bool)  # no valid row: both filters keep nothing
  state, _, m = ad._step(ad.frozen, ad.consts, state, x[1], nothing)
  assert int(m["num_reliable"]) == 0 and int(m["num_reliable2"]) == 0 and int(state.step) == 2
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.trainable, state.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))
  # And the same state steps on with a real batch (the key advanced: the next permutations are new ones).
  state, _, m = ad.step(state, x[1])
  assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before[0]),
                                                                   jax.tree.leaves(state.trainable)))


def test_a_resumed_run_draws_the_same_permutations():
  """The permutations come from the state's key, split every step: a run checkpointed through the host and
  resumed (a new adapter) is bit-identical to one run straight through."""
  model, params = tiny_model()
  method = methods.get("deyo", skip_blocks=(), ent_factor=2.0, plpd_threshold=0.0)
  ad = engine.Adapter(method, model, params, batch_size=8, seed=5)
  xs = batches(3, 8, last=6)
  straight = ad.init_state()
  for x in xs:
    straight, logits, m = ad.step(straight, x)
  assert 0 < int(m["num_reliable2"]) < 6  # PLPD decides: the permutations matter
  half = ad.init_state()
  for x in xs[:2]:
    half, _, _ = ad.step(half, x)
  other = engine.Adapter(method, model, params, batch_size=8, seed=5)
  resumed, logits2, _ = other.step(other.state_from_host(ad.state_to_host(half)), xs[2])
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits2))
  for a, b in zip(jax.tree.leaves(ad.state_to_host(straight)), jax.tree.leaves(other.state_to_host(resumed))):
    np.testing.assert_array_equal(a, b)


def test_lr_doubles_at_batch_size_one():
  hp = {"skip_blocks": (), "ent_factor": 2.0, "plpd_threshold": -1.0}
  for a, b in zip(adapted_at_batch_one("deyo", **hp), adapted_at_batch_one("deyo", **hp, lr=2 * 0.001 / 64)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.torch
def test_deyo_matches_the_official_style_reference():
  """Same weights, batches and patch permutations: identical predictions, the same counts through both
  filters at every step (each keeps some and drops some), and the same adapted LayerNorms."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity
  from test_torch_agreement import CFG

  model, sd = timm_parity.random_model(CFG)
  # A sharper head and a stronger position embedding: confident predictions that the patch shuffle changes.
  sd["head.weight"], sd["pos_embed"] = HEAD_SCALE * sd["head.weight"], POS_SCALE * sd["pos_embed"]
  b, steps = 8, 6
  hp = dict(ent_factor=ENT_FACTOR, plpd_threshold=PLPD_THRESHOLD)
  method = methods.get("deyo", **hp)
  ad = engine.Adapter(method, create(CFG), weights.timm_to_flax(sd, CFG), batch_size=b)
  state = ad.init_state()
  rng, perms = state.rng, []
  for _ in range(steps):  # the permutations the JAX step draws, fed to the reference
    rng, p = method.step_permutations(rng, b)
    perms.append(np.asarray(p))
  ref = make_reference("deyo", timm_parity.timm_model(CFG, sd), b, permutations=perms, **hp)
  src = {k: v for k, v in weights.flax_to_timm(ad.params(state)).items() if k in ref.adapted_state()}
  data = np.random.default_rng(1)
  counts = []
  for n in (b,) * (steps - 1) + (5,):
    x = data.standard_normal((n, 32, 32, 3)).astype(np.float32)
    state, logits, metrics = ad.step(state, x)
    t_logits = ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    logits = np.asarray(logits)[:n]
    float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
    np.testing.assert_allclose(logits, t_logits, atol=1e-4, rtol=1e-4)
    counts.append((int(metrics["num_reliable"]), int(metrics["num_reliable2"])))
  print(f"deyo: (filter 1, filter 2) kept per step {counts}")
  assert counts == ref.counts
  # No sample decided by float noise: every entropy and PLPD of the reference is clear of its threshold.
  assert min(ref.threshold_gaps) > 1e-4, min(ref.threshold_gaps)
  total = sum(n for n in (b,) * (steps - 1) + (5,))
  assert 0 < sum(c[0] for c in counts) < total and 0 < sum(c[1] for c in counts) < sum(c[0] for c in counts)
  js = {k: v for k, v in weights.flax_to_timm(ad.params(state)).items() if k in src}
  worst, worst_update, excess = float_checks.compare_updates(js, src, ref.adapted_state())
  print(f"deyo: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4 and excess <= 0


# On the random 10-class model (head x2, position embedding x10) the entropies are 0.07-0.55 ln 10 and the
# PLPDs -0.4 to 0.3: these thresholds make both filters keep some samples and drop others.
HEAD_SCALE, POS_SCALE = 2.0, 10.0
ENT_FACTOR = 0.3
PLPD_THRESHOLD = 0.05
