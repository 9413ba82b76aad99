"""DePT-G (`pcsr_jax.methods.dept`, `pcsr_jax.models.prompted`) and its source stage (`train_prompts`).

Tiny models throughout: the prompt insertion against a plain re-statement, the kNN pseudo-labels, padding,
the compiled step with a wrapping bank, the one-line errors, and the source stage's resume and determinism.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import engine, harness, methods
from pcsr_jax.errors import UserError
from pcsr_jax.methods import dept
from pcsr_jax.methods.base import split
from pcsr_jax.models import prompted, vit
from tiny import TINY, batches, dept_prompts, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model, params = tiny_model()
  return model, params, dept_prompts(model, params, tmp_path_factory.mktemp("prompts"))


def _layernorm(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + vit.LN_EPS) * p["scale"] + p["bias"]


def test_prompts_enter_before_the_class_token_and_are_swapped_at_each_stage_boundary(tiny):
  """``ViT_DePT.forward`` re-stated by hand from the timm blocks: stage prompts prepended before the class
  token after the position embedding, the previous stage's prompt outputs dropped at each boundary, the final
  norm on all tokens, the feature at index P, the last stage's prompt outputs normalised, the others not."""
  model, params, folder = tiny
  cfg = TINY.__class__(**{**TINY.to_dict(), "depth": 4})  # 2 stages of 2 blocks
  model4, params4 = tiny_model(cfg)
  pc = prompted.PromptConfig(stages=2, prompts=3, dino_hidden=16, dino_bottleneck=8, dino_out=12)
  pm = prompted.create(model4, pc)
  full = dict(params4, **jax.device_get(prompted.init_extra(pm, jax.random.key(5))))
  x = batches(1, 2, cfg)[0]
  feature, logits, outs = jax.jit(lambda p, x: pm.apply({"params": p}, x, outputs=True))(full, x)

  tokens = vit.PatchEmbed(cfg.patch_size, cfg.embed_dim).apply({"params": full["patch_embed"]}, x)
  tokens = np.asarray(tokens)
  cls = np.broadcast_to(np.asarray(full["cls_token"]), (2, 1, cfg.embed_dim))
  h = np.concatenate([cls, tokens], axis=1) + np.asarray(full["pos_embed"])
  block = vit.Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_dim)
  P, prompts, kept = 3, np.asarray(full["prompts"]), []
  h = np.concatenate([np.broadcast_to(prompts[0], (2, P, cfg.embed_dim)), h], axis=1)
  for i in range(4):
    h = np.asarray(block.apply({"params": full[f"blocks_{i}"]}, h))
    if i == 1:  # end of stage 0: its prompt outputs leave, stage 1's prompts come in
      kept.append(h[:, :P])
      h = np.concatenate([np.broadcast_to(prompts[1], (2, P, cfg.embed_dim)), h[:, P:]], axis=1)
  assert h.shape[1] == P + 1 + cfg.num_patches
  h = _layernorm(h, full["norm"])
  kept.append(h[:, :P])
  np.testing.assert_allclose(feature, h[:, P], atol=1e-5)
  np.testing.assert_allclose(logits, h[:, P] @ full["head"]["kernel"] + full["head"]["bias"], atol=1e-5)
  np.testing.assert_allclose(outs, np.stack(kept), atol=1e-5)
  assert not np.allclose(h[:, 0], h[:, P])  # the feature is not the first token


def test_backbone_params_stay_the_checkpoints_and_heads_are_extra(tiny):
  model, params, folder = tiny
  prep = methods.get("dept-g", prompts=folder).prepare(model, params, jax.random.key(0), 8)
  for k in params:
    if k != "head":
      jax.tree.map(np.testing.assert_array_equal, prep.params[k], params[k])
  assert set(prep.params) - set(params) == {"prompts", "dino_0", "dino_1"}
  frozen, trainable = split(prep.params, prep.is_trainable)
  assert set(trainable) == {"prompts", "dino_0", "dino_1", "head"} and "blocks_0" in frozen
  frozen, trainable = split(prep.params, methods.get("dept-g", prompts=folder, adapt_head=False,
                                                     adapt_dino_heads=False).is_trainable)
  assert set(trainable) == {"prompts"}


def _state(method, prep):
  frozen, trainable = split(prep.params, prep.is_trainable)
  opt = prep.tx.init(trainable)
  from pcsr_jax.methods.base import AdaptState
  return frozen, AdaptState(trainable=trainable, opt_state=opt, step=jnp.zeros((), jnp.int32),
                            rng=jax.random.key(0), resets=jnp.zeros((), jnp.int32),
                            extra=method.init_extra(prep, trainable, opt))


def test_pseudo_labels_are_the_argmax_until_warm_then_the_mean_probs_of_the_nearest_bank_entries(tiny):
  model, params, folder = tiny
  method = methods.get("dept-g", prompts=folder, queue_size=32, warmup=20, num_neighbors=3)
  prep = method.prepare(model, params, jax.random.key(0), 8)
  frozen, state = _state(method, prep)
  weak = batches(1, 8, seed=3)[0]
  feats, logits = dept.feature_logits(prep, prep.params, weak)
  rng = np.random.default_rng(0)
  bank_f = rng.standard_normal((32, TINY.embed_dim)).astype(np.float32)
  bank_p = rng.dirichlet(np.ones(10), 32).astype(np.float32)
  for filled, want_knn in ((19, False), (20, True), (32, True)):
    st = state.replace(extra=state.extra.replace(bank_feats=jnp.asarray(bank_f), bank_probs=jnp.asarray(bank_p),
                                                 bank_filled=jnp.asarray(filled, jnp.int32)))
    labels, use_knn = method.pseudo_labels(prep, frozen, st, jnp.asarray(weak))
    assert bool(use_knn) == want_knn
    if not want_knn:
      np.testing.assert_array_equal(labels, np.argmax(logits, 1))
      continue
    f = np.asarray(feats) / np.linalg.norm(feats, axis=1, keepdims=True)
    b = bank_f[:filled] / np.linalg.norm(bank_f[:filled], axis=1, keepdims=True)
    nearest = np.argsort(1 - f @ b.T, axis=1)[:, :3]  # soft_k_nearest_neighbors, cosine
    np.testing.assert_array_equal(labels, np.argmax(bank_p[nearest].mean(1), 1))


@pytest.mark.slow
def test_padded_rows_change_nothing(tiny):
  """A batch of 5 and the same 5 rows padded to 8 with garbage: the same update, teacher, center and bank."""
  model, params, folder = tiny
  method = methods.get("dept-g", prompts=folder, queue_size=16, warmup=0, num_neighbors=2)
  prep = method.prepare(model, params, jax.random.key(0), 8)
  frozen, state = _state(method, prep)
  x = jnp.asarray(batches(1, 8, seed=4)[0])
  views = method.draw_views(jax.random.key(1), x)
  # A non-empty bank: the kNN labels are in play.
  state = state.replace(extra=state.extra.replace(
      bank_feats=jax.random.normal(jax.random.key(2), state.extra.bank_feats.shape),
      bank_probs=jax.nn.softmax(jax.random.normal(jax.random.key(3), state.extra.bank_probs.shape)),
      bank_filled=jnp.asarray(6, jnp.int32), bank_ptr=jnp.asarray(6, jnp.int32)))
  garbage = lambda v: v.at[5:].set(37.0)
  adapt = jax.jit(lambda *a: method.adapt(prep, frozen, *a))
  s8, _, m8 = adapt(state, garbage(x), jnp.arange(8) < 5, tuple(map(garbage, views)))
  s5, _, m5 = adapt(state, x[:5], jnp.ones(5, bool), tuple(v[:5] for v in views))
  for a, b in zip(jax.tree.leaves((s8.trainable, s8.extra)), jax.tree.leaves((s5.trainable, s5.extra))):
    np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
  assert int(s8.extra.bank_filled) == 11 and int(s8.extra.bank_ptr) == 11
  np.testing.assert_allclose(m8["loss"], m5["loss"], rtol=1e-5)
  assert not np.allclose(s8.trainable["prompts"], state.trainable["prompts"])  # it adapted


@pytest.mark.slow
def test_engine_step_compiles_once_and_runs_as_the_bank_wraps(tiny):
  model, params, folder = tiny
  ad = engine.Adapter(methods.get("dept-g", prompts=folder, queue_size=16, warmup=12), model, params, batch_size=8)
  state, knn = ad.init_state(), []
  for x in batches(5, 8, last=5, seed=2):  # 37 samples through a 16-entry bank
    state, logits, metrics = ad.step(state, x)
    knn.append(int(metrics["knn"]))
    assert bool(metrics["finite"]) and np.isfinite(np.asarray(logits)[: len(x)]).all()
  assert ad.num_traces == 1 and knn == [0, 0, 1, 1, 1]
  assert int(state.extra.bank_filled) == 16 and int(state.extra.bank_ptr) == 37 % 16
  assert not np.allclose(state.extra.teacher["prompts"], ad.init_state().extra.teacher["prompts"])


def test_without_prompts_it_stops_with_one_line_that_says_how_to_make_them(tiny, tmp_path):
  model, params, folder = tiny
  with pytest.raises(UserError, match=r"^dept-g prompts: needs prompts and DINO heads trained on source data; "
                                      r"train them first: python experiments/train_prompts.py ") as e:
    engine.Adapter(methods.get("dept-g"), model, params, batch_size=4)
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match=rf"^dept-g prompts {tmp_path}: no record.json and params.npz there"):
    methods.get("dept-g", prompts=str(tmp_path)).check_inputs()
  other = tiny_model(seed=1)[1]  # prompts trained from another checkpoint
  with pytest.raises(UserError, match=r"trained from another checkpoint"):
    engine.Adapter(methods.get("dept-g", prompts=folder), model, other, batch_size=4)
  with pytest.raises(UserError, match=r"^dept-g prompts: expected None or a string, got 1.5$"):
    methods.DePTG(prompts=1.5)


def test_the_harness_refuses_before_any_work(tmp_path):
  hf.make_world(tmp_path, ("fog",), classes=2, per_class=2)
  cfg = harness.RunConfig(data=str(tmp_path / "data"), checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "o"),
                          corruptions=("fog",), seeds=(1,), batch_size=4, progress=False, methods=("source", "dept-g"))
  with pytest.raises(UserError, match=r"^dept-g prompts: needs prompts"):
    harness.run(cfg, log=lambda *a: None)
  assert not (tmp_path / "o" / "results.json").exists()


# ---------------------------------------------------------------- the source stage

@pytest.fixture(scope="module")
def source_world(tmp_path_factory):
  root = tmp_path_factory.mktemp("dept_source")
  hf.make_imagenet_c(str(root / "data"), corruptions=("fog",), classes=4, per_class=4)
  hf.make_checkpoint(str(root / "ckpt"))
  return root


def _train(world, out, *extra):
  from pcsr_jax.experiments import train_prompts

  argv = ["--checkpoint", str(world / "ckpt"), "--source-data", str(world / "data" / "fog" / "5"), "--out", str(out),
          "--batch-size", "4", "--epochs", "2", "--stages", "2", "--prompts", "2", "--dino-hidden", "16",
          "--dino-bottleneck", "8", "--dino-out", "12", "--warmup-steps", "2", "--checkpoint-every", "2",
          "--no-progress", *extra]
  assert train_prompts.main(argv) == 0


def _arrays(out):
  with np.load(os.path.join(out, "params.npz")) as z:
    return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_train_prompts_resumes_bit_identically_and_is_deterministic(source_world, tmp_path):
  """8 steps straight, twice (the same bits), against 3 steps, a stop, and --resume (across an epoch end);
  another seed gives other prompts. The dept-g method then reads the folder."""
  w = source_world
  _train(w, tmp_path / "a")
  _train(w, tmp_path / "b")
  _train(w, tmp_path / "r", "--stop-after", "3")
  assert not (tmp_path / "r" / "record.json").exists() and (tmp_path / "r" / "resume" / "state.json").exists()
  _train(w, tmp_path / "r", "--resume")
  _train(w, tmp_path / "s", "--seed", "1")
  a, b, r, s = (_arrays(tmp_path / n) for n in "abrs")
  assert set(a) == {"prompts", "head/kernel", "head/bias"} | {k for k in a if k.startswith("dino_")}
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(a[k], r[k])
  assert not np.array_equal(a["prompts"], s["prompts"])
  rec = json.loads((tmp_path / "a" / "record.json").read_text())
  assert rec["steps"] == 8 and rec["command"].startswith("python experiments/train_prompts.py --checkpoint")
  from pcsr_jax import checkpoint
  model, params, _ = checkpoint.load(str(w / "ckpt"))
  assert rec["checkpoint_sha256"] == checkpoint.params_digest(params)
  prep = methods.get("dept-g", prompts=str(tmp_path / "a")).prepare(model, params, jax.random.key(0), 4)
  np.testing.assert_array_equal(prep.params["prompts"], a["prompts"])
  with pytest.raises(UserError, match=r"--resume: no saved progress"):
    _train(w, tmp_path / "a", "--resume")
  with pytest.raises(UserError, match=r"holds trained prompts already"):
    _train(w, tmp_path / "a")


def test_weak_view_is_a_resized_random_crop_and_flip():
  """At resize = input size the weak view is the image or its mirror (8-bit input: the resize is exact); at
  the official ratio (32 -> 37 px) it is a 32 px crop of 8-bit levels, drawn per sample."""
  from pcsr_jax import augment

  x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3)) / 255.0, jnp.float32)
  weak = jax.jit(augment.dept_weak, static_argnums=2)
  same = weak(jax.random.key(0), x, 32)
  for a, b in zip(np.asarray(same), np.asarray(x)):
    assert np.allclose(a, b, atol=1e-6) or np.allclose(a, b[:, ::-1], atol=1e-6)
  copies = jnp.broadcast_to(x[:1], x.shape)
  big = np.asarray(weak(jax.random.key(1), copies, 37))
  assert big.shape == x.shape and np.allclose(big * 255, np.round(big * 255), atol=1e-4)
  assert len({b.tobytes() for b in big}) > 1  # one draw per sample
  strong = np.asarray(jax.jit(augment.dept_strong, static_argnums=2)(jax.random.key(2), x, (0.2, 1.0)))
  assert strong.shape == x.shape and strong.min() >= 0 and strong.max() <= 1
