"""DCT: the generated q/k/v token (its attention against a direct computation, the q third without gradient), the
adapted set, and agreement with the PyTorch reference written from the official ``yushuntang/DCT`` code
(``benchmarks/torch_methods/dct.py``) on a plain stream and on one where SAR's reset fires on and off."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import agreement
from pcsr_jax import engine, methods, weights
from pcsr_jax.methods.base import AUTHORS_SKIP_BLOCKS, is_block_layernorm_param
from pcsr_jax.models import create
from pcsr_jax.models.vit import Attention
from test_methods import flat_paths
from tiny import batches, tiny_model


def test_the_generated_token_joins_the_keys_and_values_only():
  """`Attention` with ``extra_qkv`` equals softmax attention over the T tokens plus one whose k and v are the
  given ones, for the T queries; the extra query changes nothing."""
  b, t, d, h = 2, 5, 8, 2
  rng = np.random.default_rng(0)
  x, extra = rng.standard_normal((b, t, d)).astype(np.float32), rng.standard_normal((b, 3 * d)).astype(np.float32)
  attn = Attention(d, h)
  params = attn.init(jax.random.key(0), x)
  out = np.asarray(attn.apply(params, x, extra_qkv=extra))
  other_q = extra.copy()
  other_q[:, :d] += 5.0
  np.testing.assert_array_equal(out, np.asarray(attn.apply(params, x, extra_qkv=other_q)))
  p = params["params"]
  qkv = (x @ p["qkv"]["kernel"] + p["qkv"]["bias"]).reshape(b, t, 3, h, d // h)
  q, k, v = (qkv[:, :, i] for i in range(3))
  e = extra.reshape(b, 1, 3, h, d // h)
  k, v = np.concatenate([k, e[:, :, 1]], 1), np.concatenate([v, e[:, :, 2]], 1)
  w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // h) ** -0.5, -1)
  want = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d) @ p["proj"]["kernel"] + p["proj"]["bias"]
  np.testing.assert_allclose(out, np.asarray(want), rtol=1e-5, atol=1e-5)


def test_generators_and_the_authors_layernorms_adapt_and_the_q_third_gets_no_gradient():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("dct", blocks=(0,), skip_blocks=(1,), margin_factor=2.0, lr_generator=0.5),
                      model, params, batch_size=8, seed=3)
  state = ad.init_state()
  norms = {p for p in flat_paths(params) if is_block_layernorm_param(tuple(p.split("/")), (1,))}
  assert flat_paths(state.trainable) == norms | {"qkv_gen_0/kernel", "qkv_gen_0/bias"}
  assert methods.get("dct").skip_blocks == AUTHORS_SKIP_BLOCKS
  d = model.config.embed_dim
  k0 = np.asarray(state.trainable["qkv_gen_0"]["kernel"])
  assert k0.shape == (d, 3 * d) and 0 < np.abs(k0).max() <= d ** -0.5  # PyTorch's default Linear init
  for x in batches(3, 8):
    state, _, m = ad.step(state, x)
  assert int(state.resets) == 0 and int(m["num_reliable"]) > 0
  k = np.asarray(state.trainable["qkv_gen_0"]["kernel"])
  np.testing.assert_array_equal(k[:, :d], k0[:, :d])  # the query third never moves
  assert np.abs(k[:, d:] - k0[:, d:]).max() > 1e-4
  other = engine.Adapter(methods.get("dct"), model, params, batch_size=8, seed=4)
  assert not np.array_equal(np.asarray(other.init_state().trainable["qkv_gen_0"]["kernel"]),
                            np.asarray(ad.init_state().trainable["qkv_gen_0"]["kernel"]))  # drawn from the seed


def _generators(params, blocks, adapted) -> dict[str, np.ndarray]:
  """The ``adapted`` generators under the reference's names (torch Linear layout); ``qkv_gen_j`` is block
  ``blocks[j]``'s."""
  out = {}
  for j, i in enumerate(blocks):
    if not adapted((f"qkv_gen_{j}", "kernel")):
      continue
    out[f"blocks.{i}.attn.generator.weight"] = np.asarray(params[f"qkv_gen_{j}"]["kernel"]).T
    out[f"blocks.{i}.attn.generator.bias"] = np.asarray(params[f"qkv_gen_{j}"]["bias"])
  return out


def _agree(case: str, hp: dict, steps: int, seed: int, cfg=agreement.CFG, margin: float = 0.9):
  """DCT and its reference on one stream (same weights, generators and batches); returns the JAX adapter, its
  final state and the reference."""
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import timm_parity

  sd = agreement.random_model(cfg=cfg)
  ad = agreement.adapter("dct", sd, cfg=cfg, margin_factor=margin, **hp)
  p = ad.prep.params
  blocks = methods.get("dct").generated_blocks(cfg.depth)
  gens = {i: (np.asarray(p[f"qkv_gen_{j}"]["kernel"]).T, np.asarray(p[f"qkv_gen_{j}"]["bias"]))
          for j, i in enumerate(blocks)}
  ref = make_reference("dct", timm_parity.timm_model(cfg, sd), agreement.B,
                       margin=margin * np.log(cfg.num_classes), generator_init=gens, lr_norm=hp.get("lr"),
                       lr_generator=hp.get("lr_generator", 0.01), reset_constant=hp.get("reset_constant", 0.2))
  state, trace = agreement.run(ad, ref, agreement.stream(steps, seed=seed))  # CFG_L has CFG's image size
  agreement.check_sar_stream(f"dct {case}", trace, ref, state, hp.get("reset_constant") if case == "resets" else None)
  worst, worst_update = agreement.compare(ad, state, ref, lambda ps: _generators(ps, blocks, ad.prep.is_trainable))
  print(f"dct {case}: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  return ad, state, ref


@pytest.mark.torch
@pytest.mark.parametrize("case", ["plain", "resets"])
def test_dct_matches_the_official_style_reference(case):
  """Same weights, generators and batches: identical predictions (the first forward's) at every step, the same
  filter counts, EMA and resets, the same adapted LayerNorms and generators."""
  hp, steps, seed = {"plain": ({}, 5, 0), "resets": (dict(lr=0.1, lr_generator=1.0, reset_constant=1.5), 10, 1)}[case]
  _agree(case, hp, steps, seed)


# ViT-L's depth at a tiny width: main.py's vitlarge_timm branch (DCT_Attention in net.blocks[:21]).
CFG_L = dataclasses.replace(agreement.CFG, depth=24)


def test_vit_l_depth_takes_the_official_layout():
  """At 24 blocks: generators in blocks 0-20; those of 9-11 run but stay frozen (dct.py's name test), so blocks
  0-8 and 12-20 adapt their LayerNorms and generators: 108 tensors, as the official collect_params lists."""
  model = create(CFG_L)
  params = weights.timm_to_flax(agreement.random_model(cfg=CFG_L), CFG_L)
  ad = engine.Adapter(methods.get("dct"), model, params, batch_size=agreement.B)
  assert ad.prep.model.qkv_tokens.blocks == tuple(range(21))
  state = ad.init_state()
  adapted = {int(p.split("/")[0].split("_")[-1]) for p in flat_paths(state.trainable)}
  assert adapted == set(range(9)) | set(range(12, 21))  # blocks_i for norms and qkv_gen_j (j == i here) alike
  assert len(jax.tree_util.tree_leaves(state.trainable)) == 108
  assert {p for p in flat_paths(state.trainable) if p.startswith("qkv_gen_")} == {
      f"qkv_gen_{j}/{k}" for j in (*range(9), *range(12, 21)) for k in ("kernel", "bias")}
  assert methods.get("dct").generated_blocks(12) == tuple(range(9))  # ViT-B's: net.blocks[:9]


@pytest.mark.torch
def test_dct_matches_the_reference_at_vit_l_depth():
  """The official ViT-L layout against the reference built as main.py's vitlarge_timm branch: the same
  predictions, filters and adapted tensors (108); the frozen generators of blocks 9-11 are bit-equal to their
  init on both sides after the stream."""
  ad, state, ref = _agree("vit-l", dict(lr=0.05, lr_generator=0.5), 4, 2, cfg=CFG_L, margin=0.85)
  assert len(ref.adapted_state()) == 108
  for j in (9, 10, 11):
    np.testing.assert_array_equal(np.asarray(ad.params(state)[f"qkv_gen_{j}"]["kernel"]),
                                  np.asarray(ad.prep.params[f"qkv_gen_{j}"]["kernel"]))
    np.testing.assert_array_equal(ref.model.blocks[j].attn.generator.weight.detach().numpy(),
                                  np.asarray(ad.prep.params[f"qkv_gen_{j}"]["kernel"]).T)
