"""PEA: no parameter adapts; every block's tokens are aligned to the source statistics with weights from a plain
pass over the views; drift spikes, skipped blocks and the entropy reset; and agreement with the PyTorch reference
written from the official ``TheMaXiao/PEA_TTA`` code (``benchmarks/torch_methods/pea.py``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import split
from pcsr_jax.methods.pea import make_view, view_names
from pcsr_jax.models import ViTConfig, create

# agreement.CFG at half its depth: PEA treats every block alike, and each block costs an eigh per view to compile
CFG = ViTConfig(embed_dim=48, depth=6, num_heads=3, patch_size=8, img_size=32, num_classes=10)
THRESHOLD = 0.3  # entropy_threshold: a jump the test stream's third domain makes (the official 1.0 is for ImageNet)


def _domain(steps: int, last: int, seed: int, scale: float, shift: float) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  sizes = [agreement.B] * (steps - 1) + [last]
  return [(scale * rng.standard_normal((n, CFG.img_size, CFG.img_size, 3)) + shift).astype(np.float32)
          for n in sizes]


def _domains() -> list[list[np.ndarray]]:
  """Three domains, each ending in a ragged batch; the third's inputs jump from high contrast to nearly flat."""
  return [_domain(3, 5, seed=1, scale=1.0, shift=0.0), _domain(3, 3, seed=2, scale=1.0, shift=0.5),
          _domain(2, 8, seed=3, scale=5.0, shift=0.0) + _domain(2, 6, seed=4, scale=0.1, shift=2.0)]


def _source(seed: int = 11) -> list[np.ndarray]:
  return agreement.stream(3, seed=seed)


def _adapter(sd: dict, src: list[np.ndarray], **hp) -> engine.Adapter:
  method, model = methods.get("pea", **hp), create(CFG)
  params = weights.timm_to_flax(sd, CFG)
  prep = method.prepare(model, params, jax.random.key(0), agreement.B)
  frozen, trainable = split(prep.params, prep.is_trainable)
  stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, None) for x in src]))
  return engine.Adapter(method, model, params, batch_size=agreement.B, source_stats=stats)


def test_views_hyperparameters_and_nothing_trainable():
  assert view_names(2, True, True, 0.9) == ("orig", "centercrop", "hflip")  # the README's K = 2 + original
  assert view_names(3, False, True, 0.9) == ("centercrop", "hflip", "centercrop_hflip")
  assert view_names(2, True, False, 0.9) == ("orig", "centercrop") and view_names(2, True, True, 1.0)[1] == "hflip"
  assert methods.get("pea").cost == "6F"
  with pytest.raises(UserError, match=r"^pea include_original: expected True when n_aug_max is 0"):
    methods.get("pea", n_aug_max=0, include_original=False)
  with pytest.raises(UserError, match=r"^pea group_size: expected"):
    methods.get("pea", group_size=0)
  with pytest.raises(UserError, match=r"^pea n_aug_max: expected"):
    methods.get("pea", n_aug_max=4)
  model = create(CFG)
  params = weights.timm_to_flax(agreement.random_model(cfg=CFG), CFG)
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("pea"), model, params, batch_size=4, eval_order="after",
                   source_stats={"mean": 0, "var": 0, "cov_sqrt": 0})


@pytest.mark.torch
@pytest.mark.parametrize("size", [32, 30])
def test_views_are_torchvisions_crop_resize_and_flip(size):
  from benchmarks.torch_methods import pea as ref

  x = np.random.default_rng(0).standard_normal((2, size, size, 3)).astype(np.float32)
  for name in ("centercrop", "hflip", "centercrop_hflip"):
    mine = np.asarray(make_view(x, name, 0.9))
    theirs = ref.view(agreement.nchw(x), name, 0.9).numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    assert np.abs(mine - x).max() > 0.1


@pytest.mark.torch
def test_pea_matches_the_official_style_reference():
  """Three domains, the engine's reset before the second (``each_shift_reset``), every domain ending in a
  ragged batch, the third's inputs jumping from high contrast to nearly flat images (an entropy spike): the same
  predictions, logits within 1e-4, the same per-step counts (blocks aligned, drift spikes, blocks pass 1 skips,
  entropy resets), and every block's target mean and covariance within 5e-4 of their size (at most 1.3e-4: the
  near-flat batch that restarts the statistics after the entropy reset; 1e-5 elsewhere).
  Every rule fires: first updates, spikes (a block's second update always is one), EMA updates, skipped blocks,
  an entropy reset; and a skipped block's statistics stay as they were."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd, src = agreement.random_model(head_scale=4.0, cfg=CFG), _source()
  ad = _adapter(sd, src, entropy_threshold=THRESHOLD)
  ref = make_reference("pea", timm_parity.timm_model(CFG, sd), agreement.B,
                       source_batches=[agreement.nchw(x) for x in src], entropy_threshold=THRESHOLD)
  consts = ad.prep.consts
  for i in range(CFG.depth):  # the source statistics: mean, variance and the covariance's root per block
    np.testing.assert_allclose(np.asarray(consts["mean"][i]), ref.src_mean[i].numpy()[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(consts["var"][i]), ref.src_var[i].numpy()[0], atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(consts["cov_sqrt"][i]), ref.src_groups[i][0].numpy(), atol=2e-5)
  domains = _domains()
  state, counts, worst, domain_resets, margin = ad.init_state(), [], 0.0, 0, np.inf
  for d, xs in enumerate(domains):
    if d == 1:
      state = ad.reset(state)
      ref.reset()
      domain_resets += 1
    for x in xs:
      before = float(state.extra.entropy) if bool(state.extra.entropy_seen) else None
      state, _, metrics = agreement.step_both(ad, state, ref, x, np.ones(len(x), bool))
      if before is not None:  # no reset decided by float noise
        margin = min(margin, abs(float(metrics["entropy"]) - before - THRESHOLD))
      counts.append(tuple(int(metrics[k]) for k in ("aligned", "spikes", "skipped", "reset", "first")))
      assert counts[-1][:4] == ref.counts[-1], (counts[-1], ref.counts[-1])
      seen = np.asarray(state.extra.seen)
      assert sorted(np.flatnonzero(seen)) == sorted(ref.stats.mu), (seen, sorted(ref.stats.mu))
      for i in sorted(ref.stats.mu):
        for mine, theirs in ((state.extra.mean[i], ref.stats.mu[i][0]), (state.extra.cov[i], ref.stats.cov[i])):
          rel = float(np.abs(np.asarray(mine) - theirs.numpy()).max() / np.abs(theirs.numpy()).max())
          assert rel < 5e-4, (i, rel)
          worst = max(worst, rel)
  aligned, spikes, skipped, resets, first = (np.array(c) for c in zip(*counts))
  ema = aligned - spikes - first
  print(f"pea: (aligned, spikes, skipped, entropy reset, first) per step {counts}; domain resets {domain_resets}; "
        f"statistics max rel diff {worst:.2e}; closest entropy to a reset {margin:.3f}")
  assert resets.sum() >= 1 and domain_resets == 1 and margin > 1e-3
  assert (skipped >= 1).all() and (first > 0).sum() >= 2 and spikes.sum() > 0 and (ema > 0).sum() >= 3
  assert (aligned == 3 * (CFG.depth - skipped)).all()  # a skipped block neither moves nor updates, in every view


def test_one_aligned_forward_of_all_views_and_no_reset_policy():
  """``microbatch_variants=3`` (all views in one aligned forward): each block's statistics move once per batch;
  ``reset_on_entropy_spike=False``: on the agreement test's stream after its domain reset (where the default
  resets at the near-flat batch), the entropy jumps past its EMA + a third of that threshold, and the statistics
  are kept."""
  sd, src = agreement.random_model(head_scale=4.0, cfg=CFG), _source()
  _, second, third = _domains()
  low = THRESHOLD / 3  # its near-flat batch's jump is smaller with one aligned forward
  ad = _adapter(sd, src, entropy_threshold=low, microbatch_variants=3, reset_on_entropy_spike=False)
  state, jumps = ad.init_state(), 0
  for x in second + third:
    before = float(state.extra.entropy)
    state, _, metrics = ad.step(state, x)
    skipped = int(metrics["skipped"])
    assert int(metrics["aligned"]) == CFG.depth - skipped and int(metrics["reset"]) == 0
    if int(metrics["first"]) == 0:
      assert int(np.asarray(state.extra.seen).sum()) >= CFG.depth - skipped  # nothing dropped
      jumps += float(metrics["entropy"]) > before + low
  assert jumps >= 1
