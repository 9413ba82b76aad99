"""T3A: the fixed-size support store against the official "concatenate, sort, keep K", the class-subset head,
and the predictions of the PyTorch reference written as the official code (growing tensors)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import float_checks
from pcsr_jax import engine, methods, weights
from pcsr_jax.errors import UserError
from pcsr_jax.methods.t3a import Supports, merge_supports
from pcsr_jax.models import ViTConfig, create
from tiny import TINY, batches, tiny_model


class ListStore:
  """The official selection on growing arrays: concatenate, stable-sort each class by entropy, keep K."""

  def __init__(self, feats, labels, ent, k):
    self.feats, self.labels, self.ent, self.k = feats, labels, ent, k

  def add(self, feats, labels, ent, valid):
    self.feats = np.concatenate([self.feats, feats[valid]])
    self.labels = np.concatenate([self.labels, labels[valid]])
    self.ent = np.concatenate([self.ent, ent[valid]])
    keep = []
    for c in range(int(self.labels.max()) + 1):
      idx = np.flatnonzero(self.labels == c)
      keep.append(idx[np.argsort(self.ent[idx], kind="stable")][: self.k])
    keep = np.concatenate(keep)
    self.feats, self.labels, self.ent = self.feats[keep], self.labels[keep], self.ent[keep]


def assert_store_equals(store: Supports, ref: ListStore, num_classes: int):
  for c in range(num_classes):
    sel = ref.labels == c
    n = int(sel.sum())
    valid = np.asarray(store.valid[c])
    assert valid[:n].all() and not valid[n:].any(), (c, valid, n)
    np.testing.assert_array_equal(np.asarray(store.entropy[c, :n]), ref.ent[sel])
    np.testing.assert_array_equal(np.asarray(store.features[c, :n]), ref.feats[sel])  # same supports, same order
    assert np.isinf(np.asarray(store.entropy[c, n:])).all()
    assert not np.asarray(store.features[c, n:]).any()


def test_store_equals_concatenate_sort_keep_k_with_ties_and_padding():
  """Several batches, ragged ones padded; entropies from 4 values so that ties are everywhere (the older
  support wins, then the earlier row); some classes start below K or empty, one never gets a support, and
  batches predict a class several times or not at all."""
  rng = np.random.default_rng(0)
  c, k, d, b = 6, 3, 5, 8
  draw = lambda n: rng.integers(0, 4, n).astype(np.float32) / 4  # ties
  # Warm-up rows: 6 rows over classes 0-3 (class 3 below K, classes 4 and 5 empty).
  w_labels = np.array([0, 0, 1, 0, 2, 3])
  w_feats, w_ent = rng.standard_normal((6, d)).astype(np.float32), draw(6)
  ref = ListStore(w_feats, w_labels, w_ent, k)
  ref.add(np.zeros((0, d), np.float32), np.zeros(0, int), np.zeros(0, np.float32), np.zeros(0, bool))
  merge = jax.jit(merge_supports)
  store = merge(Supports.empty(c, k, d), w_feats, w_labels, w_ent, np.ones(6, bool))
  assert_store_equals(store, ref, c)
  for n in (8, 8, 3, 8, 5, 1):  # n real rows, padded to b
    feats = rng.standard_normal((b, d)).astype(np.float32)
    labels = rng.integers(0, c - 1, b)  # class 5 never predicted
    ent = draw(b)
    valid = np.arange(b) < n
    feats[~valid], ent[~valid] = 1e3, -1.0  # padding that would win every class if it entered
    ref.add(feats, labels, ent, valid)
    store = merge(store, feats, labels, ent, valid)
    assert_store_equals(store, ref, c)
  assert not np.asarray(store.valid[5]).any() and np.asarray(store.valid[:5]).all()


def test_t3a_warm_up_is_the_head_rows_and_class_subset_is_the_sliced_head():
  """A class-subset model's T3A is T3A of the head restricted to those classes: same supports, same logits."""
  model, params = tiny_model()
  subset = (7, 2, 5, 0)
  x = batches(3, 8, seed=1)
  sub = engine.Adapter(methods.get("t3a", filter_k=2), model.clone(class_subset=subset), params, batch_size=8)
  cfg = ViTConfig(**{**TINY.__dict__, "num_classes": len(subset)})
  sliced = jax.tree.map(np.array, params)
  sliced["head"] = {"kernel": params["head"]["kernel"][:, list(subset)], "bias": params["head"]["bias"][list(subset)]}
  small = engine.Adapter(methods.get("t3a", filter_k=2), create(cfg), sliced, batch_size=8)
  s1, s2 = sub.init_state(), small.init_state()
  rows = np.asarray(sliced["head"]["kernel"]).T
  warm = np.asarray(s2.extra.features)[np.asarray(s2.extra.valid)]
  assert {tuple(r) for r in warm} <= {tuple(r) for r in rows} and len(warm) == len(subset)
  for xb in x:
    s1, l1, _ = sub.step(s1, xb)
    s2, l2, _ = small.step(s2, xb)
    assert l1.shape == (8, len(subset))
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(s1.extra.valid), np.asarray(s2.extra.valid))


def test_t3a_hyperparameters_and_eval_order():
  model, params = tiny_model()
  with pytest.raises(UserError, match="filter_k"):
    methods.get("t3a", filter_k=0)
  with pytest.raises(UserError, match="eval_order"):
    engine.Adapter(methods.get("t3a"), model, params, batch_size=4, eval_order="after")
  ad = engine.Adapter(methods.get("t3a"), model, params, batch_size=4)
  assert ad.num_trainable == 0 and methods.get("t3a").cost == "1F"


@pytest.mark.torch
def test_t3a_predictions_match_the_official_style_reference():
  """Same weights, same stream (a ragged last batch included): identical predictions, logits within 1e-4,
  and per class the same number of supports; K = 3 so that the per-class filter drops supports."""
  import torch

  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity
  from test_torch_agreement import CFG

  model, sd = timm_parity.random_model(CFG)
  k, b = 3, 8
  ad = engine.Adapter(methods.get("t3a", filter_k=k), create(CFG), weights.timm_to_flax(sd, CFG), batch_size=b)
  ref = make_reference("t3a", timm_parity.timm_model(CFG, sd), b, filter_k=k)
  rng = np.random.default_rng(0)
  state, added, kept, worst = ad.init_state(), CFG.num_classes, [], 0.0
  for n in (b,) * 5 + (5,):
    x = rng.standard_normal((n, 32, 32, 3)).astype(np.float32)
    state, logits, metrics = ad.step(state, x)
    t_logits = ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    logits = np.asarray(logits)[:n]
    float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
    np.testing.assert_allclose(logits, t_logits, atol=1e-4, rtol=1e-4)
    worst = max(worst, float(np.abs(logits - t_logits).max() / np.abs(t_logits).max()))
    counts = np.bincount(ref.labels.argmax(1).numpy(), minlength=CFG.num_classes)
    np.testing.assert_array_equal(np.asarray(state.extra.valid).sum(1), counts)
    added += n
    kept.append(int(metrics["supports"]))
  print(f"t3a: supports kept per step {kept} of {added} added; logits max rel diff {worst:.2e}")
  assert ad.num_traces == 1  # the ragged last batch was padded, not recompiled
  assert kept[-1] < added and max(kept) <= k * CFG.num_classes  # the filter dropped supports
