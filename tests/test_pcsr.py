"""PCSR modules: identity at init, the ablation switches, parameter counts, gradient flow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax import methods
from pcsr_jax.models import pcsr
from pcsr_jax.errors import UserError
from pcsr_jax.models import init_params
from tiny import TINY, batches, tiny_model

VARIANTS = [
    pcsr.PCSRConfig(),
    pcsr.PCSRConfig(condition="class"),
    pcsr.PCSRConfig(condition="mean"),
    pcsr.PCSRConfig(condition="domain"),
    pcsr.PCSRConfig(aggregation="max"),
    pcsr.PCSRConfig(aggregation="attention"),
    pcsr.PCSRConfig(qkv_factors="independent"),
    pcsr.PCSRConfig(shared_across_layers=True),
    pcsr.PCSRConfig(dsn_input="block_input"),
    pcsr.PCSRConfig(combine="mean"),
    pcsr.PCSRConfig(combine="concat"),
    pcsr.PCSRConfig(dsn_init="identity"),
]


def with_recalibrators(config, seed=1):
  model, params = tiny_model()
  adapted = model.clone(recalibration=config)
  full = dict(params)
  full.update(init_params(adapted, jax.random.key(seed), only=lambda name: name.startswith("recal_")))
  return model, params, adapted, full


@pytest.mark.parametrize("config", [pcsr.PCSRConfig(), pcsr.PCSRConfig(shared_across_layers=True)],
                         ids=["per-layer", "shared"])
def test_init_of_the_recalibrators_alone_gives_the_whole_inits_values(config):
  """`init_params(only=...)` (PCSR's `prepare`, without compiling the backbone's init): the same bits."""
  model, params = tiny_model()
  adapted = model.clone(recalibration=config)
  key = jax.random.key(7)
  whole = init_params(adapted, key)
  alone = init_params(adapted, key, only=lambda name: name.startswith("recal_"))
  assert sorted(alone) == sorted(k for k in whole if k.startswith("recal_")) and alone
  for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves({k: whole[k] for k in alone}), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  prep = methods.get("pcsr", config=config).prepare(model, params, key, 4)  # the backbone: the checkpoint's
  assert sorted(prep.params) == sorted(whole)
  for a, b in zip(jax.tree.leaves(prep.params), jax.tree.leaves({**params, **alone}), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: str(c)[11:60])
def test_identity_at_init_and_param_count(config):
  model, params, adapted, full = with_recalibrators(config)
  x = batches(1, 4)[0]
  plain = np.asarray(jax.jit(model.apply)({"params": params}, x))
  recal = np.asarray(jax.jit(adapted.apply)({"params": full}, x))
  np.testing.assert_allclose(recal, plain, atol=1e-6, rtol=1e-6)
  added = sum(np.size(v) for k, v in full.items() if k.startswith("recal_") for v in jax.tree.leaves(v))
  assert added == pcsr.num_params(config, TINY.embed_dim, TINY.depth)
  n_recal = sum(k.startswith("recal_") for k in full)
  assert n_recal == (1 if config.shared_across_layers else TINY.depth)


def test_paper_extra_param_count_is_one_pair_at_vit_b():
  # "about 1.7M extra parameters" (paper, Sec. 4.2) = one DSN + FGN pair at d = 768.
  assert pcsr.num_params(pcsr.PCSRConfig(shared_across_layers=True), 768, 12) == 1_771_776
  assert pcsr.num_params(pcsr.PCSRConfig(), 768, 12) == 12 * 1_771_776


def test_default_fgn_init_changes_the_model():
  model, params, adapted, full = with_recalibrators(pcsr.PCSRConfig(fgn_init="default"))
  x = batches(1, 2)[0]
  diff = jax.jit(lambda p, q: adapted.apply({"params": p}, x) - model.apply({"params": q}, x))(full, params)
  assert float(jnp.abs(diff).max()) > 1e-4


def test_scale_shift_acts_on_qkv():
  """A nonzero FGN bias shifts Q, K, V by beta and scales them by 1 + gamma: the logits must move."""
  model, params, adapted, full = with_recalibrators(pcsr.PCSRConfig())
  x = batches(1, 2)[0]
  apply = jax.jit(adapted.apply)
  base = np.asarray(apply({"params": full}, x))
  bumped = jax.tree.map(lambda a: a, full)
  d = TINY.embed_dim
  bumped["recal_0"]["fgn"]["bias"] = np.concatenate([np.full(d, 0.5), np.zeros(d)]).astype(np.float32)
  assert np.abs(np.asarray(apply({"params": bumped}, x)) - base).max() > 1e-3


@pytest.mark.parametrize("factors", [1, 3], ids=["shared", "independent"])
def test_scale_shift_attention_matches_its_definition(factors):
  """`vit.Attention` with a scale-shift (applied per head-major q, k, v in the matmul path, on ``[B, T, 3, H,
  Dh]`` in the fused one) equals the definition written on the qkv projection's ``[B, T, 3, D]`` output: eq. 7's
  ``softmax(q' k'^T / sqrt(Dh)) v'`` with ``x' = gamma * x + beta`` per sample and channel, for shared (one
  factor for q, k and v) and independent factors; outputs and gradients, both implementations."""
  from pcsr_jax.models import vit
  b, t, d, h = 3, 7, 8, 2
  ks = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(ks[0], (b, t, d))
  gamma = 1.0 + 0.5 * jax.random.normal(ks[1], (b, factors, d))
  beta = 0.5 * jax.random.normal(ks[2], (b, factors, d))
  att = vit.Attention(d, h)
  params = att.init(ks[3], x)["params"]

  def reference(p, x, gamma, beta):
    qkv = (x @ p["qkv"]["kernel"] + p["qkv"]["bias"]).reshape(b, t, 3, d)
    qkv = gamma[:, None] * qkv + beta[:, None]
    q, k, v = (qkv[:, :, i].reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for i in range(3))
    a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(d // h), axis=-1)
    out = (a @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    return out @ p["proj"]["kernel"] + p["proj"]["bias"]

  def value_and_grads(fn):
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, x, gamma, beta)

  want = value_and_grads(reference)
  for impl in ("matmul", "xla"):
    module = att.clone(implementation=impl)
    got = value_and_grads(lambda p, x, g, bt: module.apply({"params": p}, x, (g, bt)))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5, err_msg=impl)


def test_similarity_is_sown_per_layer():
  _, _, adapted, full = with_recalibrators(pcsr.PCSRConfig())
  _, sown = jax.jit(lambda p, x: adapted.apply({"params": p}, x, mutable=["losses", "intermediates"]))(
      full, batches(1, 3)[0])
  sims = jax.tree.leaves(sown["losses"])
  assert len(sims) == TINY.depth and all(s.shape == (3,) for s in sims)
  assert all(float(jnp.min(s)) >= 0.0 and float(jnp.max(s)) <= 1.0 + 1e-6 for s in sims)
  tokens = jax.tree.leaves(sown["intermediates"])
  assert len(tokens) == TINY.depth and tokens[0].shape == (3, TINY.embed_dim)


def test_zero_init_fgn_sends_no_entropy_gradient_to_dsn():
  """The open point of reference-protocols.md: at step 0 only the similarity term reaches the DSN."""
  _, _, adapted, full = with_recalibrators(pcsr.PCSRConfig())
  x = batches(1, 4)[0]

  def entropy_only(p):
    logits = adapted.apply({"params": p}, x)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jnp.exp(logp) * logp, -1))

  g = jax.jit(jax.grad(entropy_only))(full)
  assert float(jnp.abs(g["recal_0"]["dsn"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(g["recal_0"]["fgn"]["kernel"]).max()) > 0.0


def test_bad_option_is_a_user_error():
  with pytest.raises(UserError, match="pcsr aggregation: expected one of avg, max, attention"):
    pcsr.PCSRConfig(aggregation="median")
