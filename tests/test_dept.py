"""DePT-G (`pcsr_jax.methods.dept`, `pcsr_jax.models.prompted`) and its source stage (`train_prompts`).

Tiny models throughout: the prompt insertion against a plain re-statement, the kNN pseudo-labels, padding,
the compiled step with a wrapping bank, the per-stage gradient clip, the one-line errors of `DePTG.check_inputs`
for damaged or foreign inputs, and the source stage's resume and determinism.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import harness_fixtures as hf
from pcsr_jax import engine, files, harness, methods
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
    methods.get("dept-g", prompts=str(tmp_path)).check_inputs(model, params, 4)
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


def test_the_harness_refuses_damaged_prompts_before_any_work(tmp_path):
  """Prompts made for the run's checkpoint whose params.npz is then cut short: the run stops with
  `DePTG.check_inputs`'s line once the checkpoint is loaded, before the earlier method (source) has run."""
  from pcsr_jax import checkpoint

  hf.make_world(tmp_path, ("fog",), classes=2, per_class=2)
  model, params, _ = checkpoint.load(str(tmp_path / "ckpt"))
  folder = dept_prompts(model, params, tmp_path / "prompts")
  npz = os.path.join(folder, "params.npz")
  data = open(npz, "rb").read()
  with open(npz, "wb") as f:
    f.write(data[: len(data) // 2])
  cfg = harness.RunConfig(data=str(tmp_path / "data"), checkpoint=str(tmp_path / "ckpt"), output=str(tmp_path / "o"),
                          corruptions=("fog",), seeds=(1,), batch_size=4, progress=False, methods=("source", "dept-g"),
                          method_args={"dept-g": {"prompts": folder}})
  lines = []
  with pytest.raises(UserError, match=rf"^dept-g prompts {re.escape(npz)}: not a readable npz"):
    harness.run(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
  assert not [line for line in lines if ": accuracy" in line]  # no run finished: source did not run
  assert not (tmp_path / "o" / "results.json").exists()


def test_gradient_clip_scales_each_prompt_stage_by_its_own_norm():
  """``utils.clip_gradients`` clips each ``prompt_list[i]`` on its own: in the stacked ``[S, P, D]`` prompts a
  stage whose gradient norm is above the clip is scaled to it, one below stays bit for bit; the head is one
  tensor; the DINO heads are not clipped. Clipped as one tensor (no ``stacked``), the small stage would shrink."""
  rng = np.random.default_rng(0)
  unit = lambda shape: (lambda a: a / np.linalg.norm(a))(rng.standard_normal(shape)).astype(np.float32)
  stage_norms = np.array([4.0, 0.5, 2.0], np.float32)
  prompts = np.stack([unit((2, 3)) * n for n in stage_norms])
  grads = {"prompts": jnp.asarray(prompts), "head": {"kernel": jnp.asarray(unit((3, 2)) * 3.0)},
           "dino_0": {"fc0": {"kernel": jnp.asarray(unit((3, 4)) * 5.0)}}}
  out = dept.clip_per_tensor(grads, 1.0, dept.is_student_vit, dept.is_prompts)
  p = np.asarray(out["prompts"])
  for i in (0, 2):
    np.testing.assert_allclose(p[i], prompts[i] / (stage_norms[i] + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(p[i]), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(p[1], prompts[1])  # 0.5 < 1: untouched
  np.testing.assert_allclose(np.linalg.norm(out["head"]["kernel"]), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(out["dino_0"]["fc0"]["kernel"], grads["dino_0"]["fc0"]["kernel"])
  whole = np.asarray(dept.clip_per_tensor(grads, 1.0, dept.is_student_vit)["prompts"])
  np.testing.assert_allclose(np.linalg.norm(whole), 1.0, rtol=1e-5)
  assert np.linalg.norm(whole[1]) < 0.5 * 0.3  # one tensor: the small stage scaled by 1 / ||[4, 0.5, 2]|| too
  assert dept.clip_per_tensor(grads, 0.0, dept.is_student_vit, dept.is_prompts) is grads  # 0: off


def _copy_prompts(folder, tmp_path) -> str:
  out = str(tmp_path / "prompts")
  shutil.copytree(folder, out)
  return out


def _resave(folder, tmp_path, edit, prompt=None) -> str:
  """The fixture's prompts and heads changed by ``edit`` (flat ``{name: array}`` in place), saved by
  `dept.save_prompts` under the fixture's record (its checkpoint) and ``prompt`` (default: the fixture's prompt
  config): a folder whose record and npz agree (SHA-256 included) but whose arrays are wrong for the model."""
  pc, trained, record = dept.load_prompts(folder)
  flat = {"/".join(k): np.array(v) for k, v in traverse_util.flatten_dict(trained).items()}
  edit(flat)
  out = str(tmp_path / "resaved")
  shutil.rmtree(out, ignore_errors=True)
  keep = {k: v for k, v in record.items() if k in ("checkpoint_sha256", "command")}
  dept.save_prompts(out, traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()}),
                    prompt or pc, keep)
  return out


def _one_line_error(method, model, params, batch_size: int, pattern: str) -> None:
  with pytest.raises(UserError, match=pattern) as e:
    method.check_inputs(model, params, batch_size)
  assert "\n" not in str(e.value)


def test_check_inputs_accepts_the_built_in_prompts_and_the_fixtures(tiny):
  """The committed prompts of the built-in model (assets/fmnist_vit_dept for assets/fmnist_vit) and the tiny
  fixture's pass every check; the built-in ones refuse another checkpoint (the tiny model)."""
  from pcsr_jax import checkpoint

  model, params, folder = tiny
  methods.get("dept-g", prompts=folder).check_inputs(model, params, 8)
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
  fm_model, fm_params, _ = checkpoint.load(os.path.join(root, "fmnist_vit"))
  built_in = methods.get("dept-g", prompts=os.path.join(root, "fmnist_vit_dept"), queue_size=128)
  built_in.check_inputs(fm_model, fm_params, 128)
  _one_line_error(built_in, model, params, 8, r"trained from another checkpoint")


def test_check_inputs_refuses_a_truncated_damaged_or_changed_npz(tiny, tmp_path):
  """A params.npz cut in half does not open; one with 64 bytes zeroed in the middle (inside an array) fails the
  zip's CRC-32 as it is read; one rewritten with a changed value (a valid npz) is not the one the record hashes;
  one with an array of integers is no trained prompts. The same checks stop `prepare` (the engine's)."""
  model, params, folder = tiny
  bad = _copy_prompts(folder, tmp_path)
  npz = os.path.join(bad, "params.npz")
  method = methods.get("dept-g", prompts=bad)
  data = open(npz, "rb").read()
  with open(npz, "wb") as f:
    f.write(data[: len(data) // 2])
  _one_line_error(method, model, params, 8, rf"^dept-g prompts {re.escape(npz)}: not a readable npz, damaged or "
                                            r"cut short \(BadZipFile: .*\); train them again$")
  with pytest.raises(UserError, match=r"not a readable npz"):
    engine.Adapter(method, model, params, batch_size=8)
  middle = len(data) // 2
  with open(npz, "wb") as f:
    f.write(data[:middle] + bytes(64) + data[middle + 64:])
  _one_line_error(method, model, params, 8, rf"^dept-g prompts {re.escape(npz)}: not a readable npz, damaged or "
                                            r"cut short \(BadZipFile: Bad CRC-32 for file '[\w/.]+'\)")
  arrays = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(dept.load_prompts(folder)[1]).items()}
  arrays["prompts"] = arrays["prompts"] + 1.0
  np.savez(npz, **arrays)
  _one_line_error(method, model, params, 8, rf"^dept-g prompts {re.escape(npz)}: its SHA-256 is not the one "
                                            r"record.json records \(changed or damaged\); train them again$")
  arrays["prompts"] = arrays["prompts"].astype(np.int32)
  np.savez(npz, **arrays)
  record = json.loads(open(os.path.join(bad, "record.json")).read())
  record["params_npz_sha256"] = files.sha256(npz)
  files.write_json(os.path.join(bad, "record.json"), record)
  _one_line_error(method, model, params, 8, rf"^dept-g prompts {re.escape(npz)}: prompts holds int32, expected "
                                            r"float32; train them again$")


def test_check_inputs_refuses_arrays_the_model_cannot_take(tiny, tmp_path):
  """Record and npz agree (the SHA-256 too), but the arrays do not fit: another prompt count or stage count than
  the record's prompt config, a missing DINO head, a head of another shape, a non-finite value, a key that is no
  param, a backbone param of another shape; and a record whose stage count does not divide the model's depth.
  Each: one line naming the file and what was expected, from ``check_inputs`` (nothing adapted or compiled)."""
  model, params, folder = tiny
  d = model.config.embed_dim

  def case(edit, pattern, prompt=None):
    out = _resave(folder, tmp_path, edit, prompt)
    _one_line_error(methods.get("dept-g", prompts=out), model, params, 8, pattern)

  def prompts_of(shape):
    def edit(flat):
      flat["prompts"] = np.full(shape, 0.1, np.float32)
    return edit

  def without_dino_1(flat):
    for k in [k for k in flat if k.startswith("dino_1/")]:
      del flat[k]

  def with_nan(flat):
    flat["prompts"][1, 2, 3] = np.nan

  case(prompts_of((2, 5, d)), rf"params.npz: prompts has shape \(2, 5, {d}\), expected \(2, 3, {d}\) for 2 stages x "
                              rf"3 prompts of this model's {d} dims \(record.json's prompt_config\)$")
  case(prompts_of((1, 3, d)), rf"params.npz: prompts has shape \(1, 3, {d}\), expected \(2, 3, {d}\) for 2 stages")
  case(without_dino_1, r"params.npz: no dino_1/\w+/\w+, expected one of shape \(\d+,( \d+)?\) for 2 stages x 3 "
                       r"prompts")
  case(lambda flat: flat.update({"head/kernel": np.zeros((d, 7), np.float32)}),
       rf"params.npz: head/kernel has shape \({d}, 7\), expected \({d}, 10\)")
  case(with_nan, r"params.npz: prompts holds 1 non-finite values, expected all finite; train them again$")
  case(lambda flat: flat.update({"extra/kernel": np.zeros(3, np.float32)}),
       r"params.npz: extra/kernel is no param of this model")
  case(lambda flat: flat.update({"blocks_0/attn/qkv/kernel": np.zeros((d, 5), np.float32)}),
       rf"params.npz: blocks_0/attn/qkv/kernel has shape \({d}, 5\), expected the checkpoint's \({d}, {3 * d}\)$")
  three = prompted.PromptConfig(stages=3, prompts=3, dino_hidden=16, dino_bottleneck=8, dino_out=12)
  case(lambda flat: None, r"stages: expected a divisor of the model's 2 blocks, got 3$", prompt=three)


def test_check_inputs_refuses_another_checkpoints_prompts_and_a_small_queue(tiny, tmp_path):
  """A record naming another checkpoint's params digest, and a kNN bank smaller than the batch: one line each
  from ``check_inputs``; a bank of exactly the batch passes."""
  model, params, folder = tiny
  other = _copy_prompts(folder, tmp_path)
  path = os.path.join(other, "record.json")
  record = json.loads(open(path).read())
  record["checkpoint_sha256"] = "0" * 64
  files.write_json(path, record)
  _one_line_error(methods.get("dept-g", prompts=other), model, params, 8,
                  rf"^dept-g prompts {re.escape(other)}: trained from another checkpoint \(its record.json's "
                  r"checkpoint_sha256 differs from this checkpoint's params\); train them first")
  _one_line_error(methods.get("dept-g", prompts=folder, queue_size=7, num_neighbors=3), model, params, 8,
                  r"^dept-g queue_size: expected at least the batch size \(8\), got 7$")
  methods.get("dept-g", prompts=folder, queue_size=8, num_neighbors=3).check_inputs(model, params, 8)


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
