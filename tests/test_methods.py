"""The methods' protocol details: what adapts, each loss, SAR's filters and recovery, empty masks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from pcsr_jax import engine, methods
from pcsr_jax.methods import base
from test_losses import np_entropy
from tiny import TINY, batches, tiny_model

B = 8


@functools.lru_cache(maxsize=None)
def adapter(method, batch_size=B, eval_order=None, seed=0):
  """One compiled adapter per configuration, shared by the tests (each run starts from init_state())."""
  model, params = tiny_model()
  return engine.Adapter(method, model, params, batch_size=batch_size, eval_order=eval_order, seed=seed)


def run(method, n=4, batch_size=B, eval_order=None, seed=0, data_seed=0, last=None, fresh=False):
  if fresh:
    model, params = tiny_model()
    ad = engine.Adapter(method, model, params, batch_size=batch_size, eval_order=eval_order, seed=seed)
  else:
    ad = adapter(method, batch_size, eval_order, seed)
  params = tiny_model()[1]
  state = ad.init_state()
  out = []
  for x in batches(n, batch_size, seed=data_seed, last=last):
    state, logits, metrics = ad.step(state, x)
    out.append((x, np.asarray(logits)[: len(x)], jax.tree.map(np.asarray, metrics)))
  return ad, state, params, out


def flat_paths(tree):
  return {"/".join(k) for k in traverse_util.flatten_dict(tree)}


def test_trainable_sets():
  model, params = tiny_model()
  tent = engine.Adapter(methods.get("tent"), model, params, batch_size=B)
  assert flat_paths(tent.init_state().trainable) == {f"blocks_{i}/{n}/{p}" for i in range(TINY.depth)
                                                    for n in ("norm1", "norm2") for p in ("scale", "bias")} | {
                                                        "norm/scale", "norm/bias"}
  sar = methods.SAR(skip_blocks=(1,))  # the tiny model has 2 blocks; the default skips blocks 9-11
  sar_ad = engine.Adapter(sar, model, params, batch_size=B)
  assert flat_paths(sar_ad.init_state().trainable) == {f"blocks_0/{n}/{p}"
                                                      for n in ("norm1", "norm2") for p in ("scale", "bias")}
  frozen_ad = engine.Adapter(methods.get("pcsr-frozen"), model, params, batch_size=B)
  recals = {f"recal_{i}" for i in range(TINY.depth)}
  assert {p.split("/")[0] for p in flat_paths(frozen_ad.init_state().trainable)} == recals
  # The authors' recipe: SAR's LayerNorms (blocks 0-8; here skip block 1 as SAR's test above) + the modules.
  pcsr_ad = engine.Adapter(methods.get("pcsr", skip_blocks=(1,)), model, params, batch_size=B)
  paths = flat_paths(pcsr_ad.init_state().trainable)
  assert {p for p in paths if not p.startswith("recal_")} == flat_paths(sar_ad.init_state().trainable)
  assert {p.split("/")[0] for p in paths if p.startswith("recal_")} == recals
  dct = engine.Adapter(methods.get("pcsr", config={"skip_blocks": [1]}), model, params, batch_size=B)
  assert {p.split("/")[0] for p in flat_paths(dct.init_state().trainable) if p.startswith("recal_")} == {"recal_0"}
  assert engine.Adapter(methods.get("source"), model, params, batch_size=B).num_trainable == 0


def test_sar_default_skips_blocks_9_to_11_of_vit_base():
  from pcsr_jax.models import configs

  paths = [(f"blocks_{i}", n, p) for i in range(12) for n in ("norm1", "norm2") for p in ("scale", "bias")]
  paths += [("norm", "scale"), ("blocks_0", "attn", "qkv", "kernel")]
  chosen = {p[0] for p in paths if methods.SAR().trainable(p)}
  assert chosen == {f"blocks_{i}" for i in range(9)}
  assert configs.get_config("vit_base_patch16_224").depth == 12


def official_layernorm_set(params, skip_names: tuple[str, ...]) -> set[str]:
  """The LayerNorm params that the official ``collect_params`` (SAR's ``sar.py``, DPAL's ``dpal.py``) adapt,
  by its own string test on the PyTorch module names ('blocks_21/norm1' is timm's 'blocks.21.norm1')."""
  chosen = set()
  for path in traverse_util.flatten_dict(params):
    nm = ".".join(path[:-1]).replace("blocks_", "blocks.")
    if len(path) < 2 or path[-2] not in ("norm1", "norm2", "norm") or any(s in nm for s in skip_names):
      continue
    if "norm." in nm or nm in ["norm"]:
      continue
    chosen.add("/".join(path))
  return chosen


def test_layernorms_at_depth_24_follow_each_official_string_test():
  """ViT-L's depth: `pcsr` freezes what DCT's and DPAL's code freeze (blocks 9-11 and 21-23), `sar` what SAR's
  code freezes (9-11 only)."""
  cfg = dataclasses.replace(TINY, depth=24, embed_dim=8, num_heads=1, num_classes=4)
  model, params = tiny_model(cfg)
  sar_names = ("blocks.9", "blocks.10", "blocks.11")
  authors_names = sar_names + ("blocks.21", "blocks.22", "blocks.23")

  def adapted_layernorms(method):
    prep = method.prepare(model, params, jax.random.key(0), 2)
    return {p for p in flat_paths(base.split(prep.params, prep.is_trainable)[1]) if not p.startswith("recal_")}

  assert adapted_layernorms(methods.get("sar")) == official_layernorm_set(params, sar_names)
  want = official_layernorm_set(params, authors_names)
  assert "blocks_12/norm1/scale" in want and "blocks_21/norm1/scale" not in want and "blocks_19/norm2/bias" in want
  assert adapted_layernorms(methods.get("pcsr")) == want
  # The ViT-L preset has the same set (it changes only the learning rates).
  assert adapted_layernorms(methods.PCSR.preset("vit_large_patch16_224")) == want


@pytest.mark.parametrize("name", ["tent", "sar", "pcsr", "pcsr-frozen"])
def test_only_intended_params_change_and_backbone_is_bit_identical(name):
  ad, state, params, _ = run(methods.get(name))
  full = traverse_util.flatten_dict(jax.tree.map(np.asarray, ad.params(state)))
  source = traverse_util.flatten_dict(ad.prep.params)
  trainable = set(traverse_util.flatten_dict(state.trainable))
  changed = {k for k in source if not np.array_equal(full[k], np.asarray(source[k]))}
  assert changed and changed <= trainable, sorted(changed - trainable)
  frozen = traverse_util.flatten_dict(ad.frozen)
  assert set(frozen) | trainable == set(full) and not set(frozen) & trainable
  for k, v in traverse_util.flatten_dict(params).items():
    if k not in trainable:
      np.testing.assert_array_equal(full[k], v)  # the frozen backbone is untouched, bit for bit


def test_tent_loss_is_mean_entropy_of_whole_batch():
  _, _, _, out = run(methods.get("tent"), n=1)
  x, logits, m = out[0]
  np.testing.assert_allclose(m["loss"], np_entropy(logits.astype(np.float64)).mean(), rtol=1e-5)


@pytest.mark.parametrize("name", ["pcsr", "pcsr-frozen"])
def test_pcsr_loss_is_reliable_entropy_plus_lambda_similarity(name):
  method = methods.get(name)
  _, _, _, out = run(method, n=1, eval_order="before")
  x, logits, m = out[0]
  ent = np_entropy(logits.astype(np.float64))
  rel = ent < method.margin(TINY.num_classes)
  assert 0 < rel.sum() < B and m["num_reliable"] == rel.sum()
  np.testing.assert_allclose(m["entropy_loss"], ent[rel].mean(), rtol=1e-5)
  assert m["similarity_loss"] < 0
  np.testing.assert_allclose(m["loss"], m["entropy_loss"] + rel.sum() / B * m["similarity_loss"], rtol=1e-5)


def test_sar_first_mask_is_strict_reliable_entropy():
  method = methods.get("sar", skip_blocks=())
  _, _, _, out = run(method, n=3)
  for x, logits, m in out:
    ent = np_entropy(logits.astype(np.float64))
    rel = ent < method.margin(TINY.num_classes)
    assert m["num_reliable"] == rel.sum()
    np.testing.assert_allclose(m["loss"], ent[rel].mean() if rel.any() else 0.0, rtol=1e-5)


def test_sar_second_pass_refilters_within_first_mask():
  # A large rho pushes some first-pass reliable samples above E0 at the perturbed weights.
  method = methods.get("sar", rho=5.0, skip_blocks=())
  _, _, _, out = run(method, n=6)
  n1 = np.array([m["num_reliable"] for _, _, m in out])
  n2 = np.array([m["num_reliable2"] for _, _, m in out])
  assert (n2 <= n1).all()
  assert (n2 < n1).any() and (n2 > 0).any()


def test_sar_ema_follows_official_recursion():
  method = methods.get("sar", skip_blocks=())
  _, _, _, out = run(method, n=5)
  ema = None
  for _, _, m in out:
    if m["num_reliable2"] > 0:
      ema = float(m["loss2"]) if ema is None else 0.9 * ema + 0.1 * float(m["loss2"])
    np.testing.assert_allclose(m["ema"], ema, rtol=1e-5)
    assert not m["reset"]


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_sar_reset_restores_params_and_keeps_sams_inner_momentum():
  """SAR's code: ``load_state_dict`` of the model and of the SAM wrapper; the inner SGD's momentum survives."""
  never = run(methods.get("sar", skip_blocks=(), reset_constant=0.0), n=2)[1]
  ad, state, _, out = run(methods.get("sar", skip_blocks=(), reset_constant=100.0), n=2)  # any EMA < 100
  assert all(bool(m["reset"]) for _, _, m in out) and int(state.resets) == 2
  src = ad.init_state()
  for a, b in zip(_leaves(state.trainable), _leaves(src.trainable)):
    np.testing.assert_array_equal(a, b)
  # Momentum after a reset is what the update left: the first step's trace, then 0.9 * it + the second gradient
  # at the source params -- equal to a run that never resets only in its first step; so compare the first step.
  one = run(methods.get("sar", skip_blocks=(), reset_constant=100.0), n=1)[1]
  one_never = run(methods.get("sar", skip_blocks=(), reset_constant=0.0), n=1)[1]
  for a, b in zip(_leaves(one.opt_state), _leaves(one_never.opt_state)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
  assert any(np.abs(a).max() > 0 for a in _leaves(state.opt_state))
  assert any(not np.allclose(a, b) for a, b in zip(_leaves(state.opt_state), _leaves(never.opt_state)))
  assert bool(state.extra.valid)  # SAR's code writes the pre-reset EMA back
  # reset_optimizer="all": the optimizer state is cleared with the params (what we did before).
  _, cleared_opt, _, _ = run(methods.get("sar", skip_blocks=(), reset_constant=100.0, reset_optimizer="all"), n=2)
  for a, b in zip(_leaves(cleared_opt.opt_state) + _leaves(cleared_opt.trainable),
                  _leaves(src.opt_state) + _leaves(src.trainable)):
    np.testing.assert_array_equal(a, b)
  _, cleared, _, _ = run(methods.get("sar", skip_blocks=(), reset_constant=100.0,
                                     clear_ema_on_reset=True), n=1)
  assert not bool(cleared.extra.valid)


def test_sar_no_reset_above_threshold():
  _, state, _, _ = run(methods.get("sar", skip_blocks=(), reset_constant=0.0), n=3)
  assert int(state.resets) == 0


@pytest.mark.parametrize("name", ["tent", "sar", "pcsr", "pcsr-frozen"])
def test_empty_mask_keeps_everything_finite(name):
  method = methods.get(name, margin_factor=0.0)  # E0 = 0: no sample is ever reliable
  ad, state, _, out = run(method, n=3)
  for leaf in jax.tree.leaves(state):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.isfinite(np.asarray(leaf)).all()
  for _, logits, m in out:
    assert np.isfinite(logits).all() and all(np.isfinite(v).all() for v in m.values())
  if name != "tent":  # TENT uses every sample; for the others an empty mask means a zero gradient
    assert all(m.get("num_reliable", 0) == 0 for _, _, m in out)
    for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(ad.init_state().trainable)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sar_lr_doubles_at_batch_size_one():
  auto = run(methods.get("sar", skip_blocks=()), n=3, batch_size=1)[1]
  manual = run(methods.get("sar", skip_blocks=(), lr=2 * 0.001 / 64), n=3, batch_size=1)[1]
  for a, b in zip(jax.tree.leaves(auto.trainable), jax.tree.leaves(manual.trainable)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sar_come_lr_at_batch_size_one_is_comes_official_formula_not_doubled():
  """COME's main.py: ``args.lr = (0.001 / 64) * bs`` for vitbase_timm, every method, no doubling at bs 1 (SAR's own
  main.py doubles it, and `sar` does): SAR-COME at batch size 1 equals its lr given as 0.001 / 64 * 1, and not
  the doubled one."""
  official = 0.001 / 64 * 1
  auto = run(methods.get("sar-come", skip_blocks=()), n=3, batch_size=1)[1]
  manual = run(methods.get("sar-come", skip_blocks=(), lr=official), n=3, batch_size=1)[1]
  doubled = run(methods.get("sar-come", skip_blocks=(), lr=2 * official), n=3, batch_size=1)[1]
  for a, b in zip(jax.tree.leaves(auto.trainable), jax.tree.leaves(manual.trainable)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(auto.trainable), jax.tree.leaves(doubled.trainable)))


def test_pcsr_vit_large_preset():
  assert (methods.PCSR.preset("vit_large_patch16_224").lr_dsn, methods.PCSR.preset("vit_large_patch16_224").lr_fgn) \
      == (0.05, 0.0001)
  assert (methods.PCSR.preset("vit_base_patch16_224").lr_dsn, methods.PCSR.preset("vit_base_patch16_224").lr_fgn) \
      == (0.2, 0.0005)


def test_unknown_method():
  from pcsr_jax.errors import UserError

  with pytest.raises(UserError, match="unknown method 'no-such-method'"):
    methods.get("no-such-method")


def test_pcsr_frozen_optional_reset_shares_sars_recovery():
  ad, state, _, out = run(methods.get("pcsr-frozen", reset=True, reset_constant=100.0), n=2)
  assert all(bool(m["reset"]) for _, _, m in out) and int(state.resets) == 2
  for a, b in zip(_leaves(state.trainable) + _leaves(state.opt_state),  # plain SGD: load_state_dict restores it
                  _leaves(ad.init_state().trainable) + _leaves(ad.init_state().opt_state)):
    np.testing.assert_array_equal(a, b)


def test_pcsr_reset_restores_modules_and_dsn_sgd_keeps_sam_momentum():
  ad, state, _, out = run(methods.get("pcsr", skip_blocks=(), reset_constant=100.0), n=2)
  assert all(bool(m["reset"]) for _, _, m in out) and int(state.resets) == 2
  src = ad.init_state()
  for a, b in zip(_leaves(state.trainable), _leaves(src.trainable)):  # LayerNorms, DSN and FGN
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_leaves(state.opt_state["sgd"]), _leaves(src.opt_state["sgd"])):  # DSN's plain SGD: restored
    np.testing.assert_array_equal(a, b)
  assert any(np.abs(a).max() > 0 for a in _leaves(state.opt_state["sam"]))  # SAM's inner SGD: kept
  _, cleared, _, _ = run(methods.get("pcsr", skip_blocks=(), reset_constant=100.0, reset_optimizer="all"), n=2)
  for a, b in zip(_leaves(cleared.opt_state), _leaves(src.opt_state)):
    np.testing.assert_array_equal(a, b)


def test_pcsr_step_order_dsn_sgd_then_sam():
  """DPAL's order: the DSN's SGD steps on the first-pass loss; SAM's params step on the second-pass gradient."""
  method = methods.get("pcsr", skip_blocks=(), reset_constant=0.0, lr_dsn=0.5, lr_fgn=0.05, lr_norm=0.05)
  ad, state, _, out = run(method, n=1)
  src = traverse_util.flatten_dict(ad.init_state().trainable)
  new = traverse_util.flatten_dict(state.trainable)
  moved = {k[-2] if k[0].startswith("recal_") else "norm" for k in src if not np.array_equal(src[k], new[k])}
  assert moved == {"dsn", "fgn", "norm"}
  frozen = ad.frozen
  x = out[0][0]
  margin = method.margin(TINY.num_classes)
  g1 = jax.grad(lambda t: method._loss(ad.prep, frozen, t, x, jnp.ones(B, bool), margin)[0])(ad.init_state().trainable)
  for k, v in traverse_util.flatten_dict(g1).items():
    if k[0].startswith("recal_") and k[-2] == "dsn":  # momentum 0 at step 1: p - lr * g
      np.testing.assert_allclose(new[k], src[k] - 0.5 * np.asarray(v), rtol=1e-5, atol=1e-7)
  assert out[0][2]["num_reliable2"] <= out[0][2]["num_reliable"]


def test_pcsr_variants_in_registry():
  assert methods.get("pcsr").recipe == "sar" and methods.get("pcsr-frozen").recipe == "frozen"
  assert methods.get("pcsr-frozen", lr_dsn=0.1).lr_dsn == 0.1
  from pcsr_jax.errors import UserError

  with pytest.raises(UserError, match="recipe"):
    methods.get("pcsr", recipe="text")
  with pytest.raises(UserError, match="reset_optimizer"):
    methods.get("sar", reset_optimizer="some")


def test_method_owned_state_is_carried_and_round_trips():
  """A method's own state (AdaptState.extra) starts from init_extra, moves with the stream and survives the
  host round trip the harness checkpoints through, bit for bit."""
  assert run(methods.get("tent"), n=1)[1].extra is None
  ad, state, _, out = run(methods.get("sar", skip_blocks=()), n=3)
  assert isinstance(state.extra, methods.optimizers.Recovery) and bool(state.extra.valid)
  np.testing.assert_allclose(float(state.extra.ema), float(out[-1][2]["ema"]), rtol=0)
  host = ad.state_to_host(state)
  back = ad.state_to_host(ad.state_from_host(host))
  assert jax.tree.structure(back) == jax.tree.structure(host)
  for a, b in zip(_leaves(back), _leaves(host)):
    np.testing.assert_array_equal(a, b)
  assert run(methods.get("pcsr-frozen"), n=1)[1].extra is None
  assert isinstance(run(methods.get("pcsr-frozen", reset=True), n=1)[1].extra, methods.optimizers.Recovery)
