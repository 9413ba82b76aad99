"""The engine: one compile per stream, padding, eval order, determinism, resets, donation, multi-device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from pcsr_jax import engine, methods
from test_methods import run
from tiny import TINY, batches, required_args, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["source", pytest.param("tent", marks=pytest.mark.core), "sar",
                                  pytest.param("pcsr", marks=pytest.mark.core), "pcsr-frozen"])
def test_one_compile_for_a_stream_with_a_ragged_last_batch(name):
  ad, _, _, out = run(methods.get(name), n=4, batch_size=6, last=2, fresh=True)
  assert ad.num_traces == 1
  assert ad._step._cache_size() == 1
  assert [len(l) for _, l, _ in out] == [6, 6, 6, 2]


def test_padding_does_not_change_the_real_samples():
  """A ragged batch gives the same logits and update as the same samples in an exact-size stream."""
  model, params = tiny_model()
  x = batches(1, 3)[0]
  padded = engine.Adapter(methods.get("pcsr"), model, params, batch_size=8)
  exact = engine.Adapter(methods.get("pcsr"), model, params, batch_size=3)
  s1, l1, m1 = padded.step(padded.init_state(), x)
  s2, l2, m2 = exact.step(exact.init_state(), x)
  np.testing.assert_allclose(np.asarray(l1)[:3], np.asarray(l2), atol=1e-5)
  for k in m1:
    np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m2[k]), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(s2.trainable)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tent", "pcsr"])
def test_batch_size_one(name):
  ad, state, _, out = run(methods.get(name, margin_factor=2.0), n=3, batch_size=1, fresh=True)
  assert ad.num_traces == 1 and all(l.shape == (1, 10) for _, l, _ in out)
  assert int(state.step) == 3


def test_eval_order_after_predicts_with_the_updated_params():
  ad, state, _, out = run(methods.get("tent", lr=0.5), n=1, eval_order="after")
  x, logits, _ = out[0]
  updated = ad.prep.model.apply({"params": ad.params(state)}, x)
  np.testing.assert_allclose(logits, np.asarray(updated), atol=1e-5)
  _, _, _, before = run(methods.get("tent", lr=0.5), n=1, eval_order="before")
  source = ad.prep.model.apply({"params": ad.prep.params}, x)
  np.testing.assert_allclose(before[0][1], np.asarray(source), atol=1e-5)
  assert np.abs(logits - before[0][1]).max() > 1e-4


def test_default_eval_orders():
  assert methods.get("pcsr-frozen").default_eval_order == "after"
  assert {methods.get(n).default_eval_order for n in ("source", "tent", "sar", "pcsr")} == {"before"}


def test_perturbed_eval_order_is_the_second_forward():
  """'perturbed' reports SAM's second forward (DPAL): neither the first forward nor the one after the update."""
  method = methods.get("pcsr", lr_fgn=0.05, lr_norm=0.05)
  before = run(method, n=2, eval_order="before", fresh=True)[3]
  pert = run(method, n=2, eval_order="perturbed", fresh=True)[3]
  after = run(method, n=2, eval_order="after", fresh=True)[3]
  for (_, b, mb), (_, p, mp), (_, a, _) in zip(before, pert, after):
    assert "perturbed_logits" not in mp  # the engine takes it out of the metrics
    np.testing.assert_allclose(mb["loss"], mp["loss"], rtol=1e-6)  # the same adaptation
    assert np.abs(p - b).max() > 1e-4 and np.abs(p - a).max() > 1e-4
  from pcsr_jax.errors import UserError

  model, params = tiny_model()
  with pytest.raises(UserError, match="eval_order: expected before or after for tent"):
    engine.Adapter(methods.get("tent"), model, params, batch_size=4, eval_order="perturbed")


@pytest.mark.parametrize("name", ["tent", "sar", "pcsr"])
def test_same_seed_is_bit_identical(name):
  a = run(methods.get(name), n=3, seed=7, fresh=True)  # two independent adapters
  b = run(methods.get(name), n=3, seed=7, fresh=True)
  keys = lambda s: jax.tree.leaves((s.trainable, s.opt_state, s.extra, s.step))
  for x, y in zip(keys(a[1]), keys(b[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for (_, la, _), (_, lb, _) in zip(a[3], b[3]):
    np.testing.assert_array_equal(la, lb)


def test_init_state_resets_to_source_and_state_is_donated():
  model, params = tiny_model()
  ad = engine.Adapter(methods.get("tent", lr=0.1), model, params, batch_size=4)
  s0 = ad.init_state()
  s1, _, _ = ad.step(s0, batches(1, 4)[0])
  assert all(x.is_deleted() for x in jax.tree.leaves(s0.trainable))  # donated to the step
  fresh = ad.init_state()
  flat_src = {k: v for k, v in jax.tree.leaves_with_path(ad._initial.trainable)}
  for kp, v in jax.tree.leaves_with_path(fresh.trainable):
    np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_src[kp]))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(s1.trainable), jax.tree.leaves(fresh.trainable)))


def _adapter(name: str, model, params, **kw) -> engine.Adapter:
  """An Adapter for ``name``; a method that needs source statistics (CFA, FOA) gets them from 3 tiny batches."""
  from pcsr_jax.methods.base import split

  method, stats = methods.get(name, **required_args(name, model, params)), None
  if method.uses_source_data():
    prep = method.prepare(model, params, jax.random.key(0), 8)
    frozen, trainable = split(prep.params, prep.is_trainable)
    source = [(x, np.arange(len(x), dtype=np.int32) % TINY.num_classes) for x in batches(3, 8, seed=7)]
    stats = method.compute_source_stats(prep, frozen, trainable, iter(source))
  return engine.Adapter(method, model, params, source_stats=stats, **kw)


@pytest.mark.parametrize("name", ["tent", "sar", "roid", "pcsr", "cfa", "adacontrast", "spa", "t3a", "foa"])
def test_row_chunk_passes_equal_one_pass(name):
  """`--row-chunk`: the model runs over the batch in passes of 4 rows (rows i, i + 2, ... of a batch of 8) with
  the same logits and updates up to float32 rounding (PCSR: its per-sample similarity, sown, too); a chunk that
  does not divide the batch is one pass."""
  model, params = tiny_model()
  res = {}
  for chunk in (None, 4, 3):
    ad = _adapter(name, model, params, batch_size=8, row_chunk=chunk)
    state, logits_all = ad.init_state(), []
    adapted = lambda s: [np.asarray(p) for p in jax.tree.leaves((s.trainable, s.extra))]  # T3A, FOA: extra
    source = adapted(ad.init_state())
    for x in batches(3, 8, last=5):  # the ragged last batch is padded to 8 rows, then chunked
      state, logits, _ = ad.step(state, x)
      logits_all.append(np.asarray(logits)[: len(x)])
    res[chunk] = (np.concatenate(logits_all), adapted(state))
  (l1, p1), (l4, p4), (l3, p3) = res[None], res[4], res[3]
  assert np.abs(l1).max() > 0.1
  np.testing.assert_allclose(l4, l1, atol=1e-5, rtol=1e-5)
  # SPA's noise strengths take SGD steps of lr 1 (by ascent; LayerNorms 0.01): rounding moves them 100x more.
  atol = 1e-4 if name == "spa" else 1e-6
  for a, b in zip(p4, p1):
    np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)
  assert any(not np.array_equal(a, b) for a, b in zip(p4, source))  # it adapted
  np.testing.assert_array_equal(l3, l1)  # 3 does not divide 8: one pass, the same program
  for a, b in zip(p3, p1):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(methods.REGISTRY))
def test_row_chunk_holds_for_every_forward_of_the_step(name):
  """With ``row_chunk=4`` at batch 8 no matmul of the step's program sees more than 4 images' tokens, for every
  method: its forwards go through `in_row_passes` (CFA, AdaContrast, SPA, T3A and FOA once went around it).
  One pass: some matmul sees at least 8 (SPA's two views: 16 rows; MEMO's 64 views of one image; ROID's and
  DeYO's kept rows and CoTTA's augmented views: the batch's 8, under `fori_loop` and `lax.cond`)."""
  import re

  model, params = tiny_model()
  d, h = TINY.embed_dim, TINY.num_heads
  # Q/K/V, proj and fc1 matmuls ([rows, T, D]) and the attention's batched ones ([rows, H, T, Dh]); FOA's have
  # its candidate axis in front (one candidate at a time on a CPU). Group 2: the rows.
  tokens = re.compile(rf"tensor<(1x)?(\d+)x({h}x)?\d+x({d}|{d // h})xf32>")
  most = {}
  for chunk in (None, 4):
    ad = _adapter(name, model, params, batch_size=8, row_chunk=chunk)
    text = ad.lower(ad.init_state(), ad.place(batches(1, 8)[0])).as_text()
    rows = [int(m.group(2)) for line in text.splitlines() if "dot_general" in line
            for m in tokens.finditer(line)]
    assert rows, "no token matmul found in the lowered step"
    most[chunk] = max(rows)
  assert most[None] >= 8 and most[4] <= 4, most


def test_bad_batch_and_eval_order():
  from pcsr_jax.errors import UserError

  model, params = tiny_model()
  with pytest.raises(UserError, match="^eval_order"):  # library errors name the argument, not a CLI flag
    engine.Adapter(methods.get("tent"), model, params, batch_size=4, eval_order="during")
  with pytest.raises(UserError, match="^batch_size: expected a positive integer"):
    engine.Adapter(methods.get("tent"), model, params, batch_size=0)
  with pytest.raises(UserError, match="^row_chunk: expected a positive integer"):
    engine.Adapter(methods.get("tent"), model, params, batch_size=4, row_chunk=0)
  ad = engine.Adapter(methods.get("tent"), model, params, batch_size=4)
  with pytest.raises(UserError, match="batch of 5 images"):
    ad.step(ad.init_state(), batches(1, 5)[0])


MULTI_DEVICE_SCRIPT = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from pcsr_jax import engine, methods
from tiny import batches, tiny_model
engine.use_cpu_devices(4)  # the harness's --cpu-devices 4
assert len(jax.devices()) == 4, jax.devices()
# MEMO with 8 views, not 64: 2 per device on 4, the same sharded path (`MEMO.draw_views`) at an eighth of the work
ARGS = {"memo": {"views": 8}}
out = {}
for name in ["sar", "pcsr", "roid", "memo", "tent", "t3a"]:  # SAR's two passes and masks; PCSR's recalibrators
  # and similarity term; ROID's kept rows gathered into chunks (`kept_row_chunks`) and sharded over the devices;
  # MEMO's views of the image in flight sharded over the devices; TENT on 4 devices in passes of 4 rows; T3A's
  # support store, replicated, merged from the rows of every device
  model, params = tiny_model()
  res = []
  for devs in (jax.devices()[:1], jax.devices()):
    chunk = 4 if name == "tent" and len(devs) == 4 else None
    ad = engine.Adapter(methods.get(name, **ARGS.get(name, {})), model, params, batch_size=6,
                        mesh=engine.data_mesh(devs), row_chunk=chunk)
    state, logits_all = ad.init_state(), []
    for x in batches(3, 6, last=3):
      state, logits, _ = ad.step(state, x)
      logits_all.append(np.asarray(logits)[: len(x)])
    adapted = jax.tree.leaves(state.trainable)
    if name == "t3a":  # no params: its store (the entropies of empty slots are inf)
      st = state.extra
      adapted = [st.features, st.valid.astype(np.float32), np.where(st.valid, st.entropy, 0.0)]
    res.append((np.concatenate(logits_all), [np.asarray(l) for l in adapted],
                ad.padded_batch, len(logits.sharding.device_set)))
  (l1, p1, b1, d1), (l4, p4, b4, d4) = res
  out[name] = dict(logit_diff=float(np.abs(l1 - l4).max()),
                   param_diff=max(float(np.abs(a - b).max()) for a, b in zip(p1, p4)),
                   pred_equal=bool((l1.argmax(-1) == l4.argmax(-1)).all()), padded=[b1, b4], devices=[d1, d4])
# MEMO's views drawn per device (`shard_map`) or on one
memo, img = methods.get("memo", **ARGS["memo"]), batches(1, 1)[0][0]
v1 = jax.jit(lambda k, x: memo.draw_views(k, x))(jax.random.key(3), img)
v4 = jax.jit(lambda k, x: memo.draw_views(k, x, engine.data_mesh()))(jax.random.key(3), img)
out["memo_views"] = dict(max_diff=float(np.abs(np.asarray(v1) - np.asarray(v4)).max()),
                         devices=len(v4.sharding.device_set))
# DDA's projection with each device running its own groups (`shard_map`) or on one device: 8 images, groups of 2
import dataclasses, jax.numpy as jnp
from pcsr_jax.methods import dda
from tiny import StandInUNet, StandInUNetConfig
unet = StandInUNet(StandInUNetConfig(image_size=16))
up = unet.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1,), jnp.int32))["params"]
meta = {"kind": "unet", "diffusion": {"diffusion_steps": 1000, "noise_schedule": "linear", "learn_sigma": True}}
method = dda.DDA(N=3, group=2, respacing="10")
y = jax.random.uniform(jax.random.key(1), (8, 16, 16, 3), minval=-1, maxval=1)
rows = np.arange(8) < 7  # one padding row, out of its group's norm
proj = {}
for mesh in (None, engine.data_mesh()):
  prep = dataclasses.replace(method.prepare_with(tiny_model()[0], None, unet, up, meta), mesh=mesh)
  fn = jax.jit(lambda p, yy, rr, k: method.project(prep, p, yy, rr, k))
  proj[mesh is None] = fn(up, y, rows, jax.random.key(2))
out["dda_projection"] = dict(max_diff=float(np.abs(np.asarray(proj[True]) - np.asarray(proj[False])).max()),
                             moved=float(np.abs(np.asarray(proj[True]) - np.asarray(y)).max()),
                             devices=len(proj[False].sharding.device_set))
# GroupNorm's closed-form backward under shard_map: the replicated scale's and bias's gradients summed over devices
from jax.sharding import PartitionSpec as P
from pcsr_jax.models import unet as unet_mod
gx = jax.random.normal(jax.random.key(3), (8, 4, 4, 64)) * 2 + 1
gp = (jnp.linspace(0.5, 1.5, 64), jnp.linspace(-1, 1, 64))
loss = lambda p, x: jnp.sum(jnp.sin(unet_mod.group_norm(x, *p)))
one_dev = jax.grad(loss, argnums=(0, 1))(gp, gx)
per_dev = jax.jit(jax.shard_map(lambda p, x: jax.grad(loss, argnums=(0, 1))(p, x), mesh=engine.data_mesh(),
                                in_specs=(P(), P("data")), out_specs=(P(), P("data"))))(gp, gx)
out["group_norm_grads"] = dict(max_diff=max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                            for a, b in zip(jax.tree.leaves(one_dev), jax.tree.leaves(per_dev))),
                               largest=float(np.abs(np.asarray(one_dev[0][0])).max()))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_four_cpu_devices_equal_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", MULTI_DEVICE_SCRIPT, os.path.join(ROOT, "tests"),
                      jax.config.jax_compilation_cache_dir], env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  # The same keys and ops on either side; XLA may vectorise a device's share of the views differently and round a
  # pixel's last bit differently (1.8e-7 seen at 2 views per device, at -O1 and -O2). A view drawn from another
  # key, or out of order, is off by far more than the tolerance.
  views = out.pop("memo_views")
  assert views["devices"] == 4 and views["max_diff"] < 1e-5, views
  # DDA's groups, one per device: the same keys, groups and ops as one device running them in turn (a group given
  # another's key or images would be off by the noise, about 1).
  proj = out.pop("dda_projection")
  assert proj["devices"] == 4 and proj["moved"] > 0.1 and proj["max_diff"] < 1e-5, proj
  # Each device's own share of the scale's and bias's gradients would be off by about 3/4 of the whole.
  gn = out.pop("group_norm_grads")
  assert gn["largest"] > 1 and gn["max_diff"] < 1e-4 * gn["largest"], gn
  for name, o in out.items():
    assert o["padded"] == [6, 8] and o["devices"] == [1, 4], (name, o)
    assert o["pred_equal"], (name, o)
    assert o["logit_diff"] < 1e-4 and o["param_diff"] < 1e-5, (name, o)
