"""The Flax ViT against timm's recorded outputs (golden fixtures; no torch needed)."""

from __future__ import annotations

import numpy as np
import pytest

import golden_fixtures
from pcsr_jax import weights
from pcsr_jax.models import create

assert golden_fixtures.NAMES, "no golden fixtures: run python -m tests.make_golden"


@pytest.mark.core
@pytest.mark.parametrize("name", golden_fixtures.NAMES)
def test_logits_and_block_features_match_timm(name):
  g = golden_fixtures.load(name)
  params = weights.timm_to_flax(g["sd"], g["cfg"])
  logits, feats = create(g["cfg"]).apply({"params": params}, g["x"], return_features=True)
  assert len(feats) == len(g["blocks"]) == g["cfg"].depth
  for i, (f, ref) in enumerate(zip(feats, g["blocks"])):
    np.testing.assert_allclose(np.asarray(f), ref, atol=1e-5, rtol=1e-5, err_msg=f"block {i}")
  np.testing.assert_allclose(np.asarray(logits), g["logits"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", golden_fixtures.NAMES)
def test_flax_to_timm_round_trip_is_exact(name):
  g = golden_fixtures.load(name)
  back = weights.flax_to_timm(weights.timm_to_flax(g["sd"], g["cfg"]))
  assert set(back) == set(g["sd"])
  for k, v in g["sd"].items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)


@pytest.mark.core
@pytest.mark.parametrize("layout", ["augreg", "big_vision"])
def test_bigvision_npz_round_trip_is_exact(layout):
  g = golden_fixtures.load(golden_fixtures.NAMES[0])
  bv = weights.timm_to_bigvision(g["sd"], g["cfg"].num_heads, layout=layout)
  assert any("MultiHeadDotProductAttention_1" in k for k in bv) == (layout == "augreg")
  back = weights.bigvision_to_timm(bv)
  assert set(back) == set(g["sd"])
  for k, v in g["sd"].items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_bigvision_without_class_slot_equals_zero_slot():
  g = golden_fixtures.load(golden_fixtures.NAMES[0])
  bv = weights.timm_to_bigvision(g["sd"], g["cfg"].num_heads, layout="big_vision")
  bv["params/pos_embedding"] = bv["params/pos_embedding"][:, 1:]  # big_vision 'tok': no class slot
  sd = weights.bigvision_to_timm(bv)
  np.testing.assert_array_equal(sd["pos_embed"][:, 0], 0.0)
  np.testing.assert_array_equal(sd["pos_embed"][:, 1:], g["sd"]["pos_embed"][:, 1:])


def test_scanned_bigvision_blocks():
  g = golden_fixtures.load(golden_fixtures.NAMES[0])
  bv = weights.timm_to_bigvision(g["sd"], g["cfg"].num_heads, layout="big_vision")
  depth = g["cfg"].depth
  blk = "params/Transformer/encoderblock_"
  names = sorted({k.split("/", 3)[3] for k in bv if k.startswith(blk)})
  scanned = {k: v for k, v in bv.items() if not k.startswith(blk)}
  for n in names:
    scanned[f"params/Transformer/encoderblock/{n}"] = np.stack([bv[f"{blk}{i}/{n}"] for i in range(depth)])
  sd = weights.bigvision_to_timm(scanned)
  for k, v in g["sd"].items():
    np.testing.assert_array_equal(sd[k], v, err_msg=k)
