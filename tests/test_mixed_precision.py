"""Mixed precision (``dtype=bfloat16``) and the attention kernels of the ViT (`pcsr_jax.models.vit`).

bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%), and a depth-2 block stack compounds it,
so bf16 logits are compared with float32 at 3% of the largest |logit| (measured here: 1.1% plain, 1.9% with
PCSR's recalibrators).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.models import create
from pcsr_jax.models.pcsr import PCSRConfig
from pcsr_jax.models.vit import compute_dtype
from tiny import TINY, batches, tiny_model

LOGIT_TOL = 0.03  # of max |logit|


def _apply(model, params, x, **kw):
  return jax.jit(lambda p, x: model.apply({"params": p}, x, **kw))(params, x)


@pytest.mark.parametrize("recal", [None, PCSRConfig(fgn_init="default")], ids=["vit", "pcsr"])
def test_bf16_logits_close_to_float32_and_outputs_float32(recal):
  model, params = tiny_model()
  if recal is not None:  # the recalibrators' params (non-zero FGN, so the scale-shift is not the identity)
    model = model.clone(recalibration=recal)
    params = {**model.init(jax.random.key(1), batches(1, 2)[0])["params"], **params}
  x = batches(1, 8, seed=3)[0]
  ref, ref_feats = _apply(model, params, x, return_features=True)
  out, feats = _apply(model.clone(dtype=jnp.bfloat16), params, x, return_features=True)
  assert out.dtype == jnp.float32 and all(f.dtype == jnp.float32 for f in feats)
  scale = float(jnp.abs(ref).max())
  err = float(jnp.abs(out - ref).max())
  print(f"bf16 vs float32: max |logit diff| {err:.3g} of max |logit| {scale:.3g}")
  assert 0 < err < LOGIT_TOL * scale  # > 0: the bf16 path really computed in bf16
  np.testing.assert_allclose(np.asarray(feats[-1]), np.asarray(ref_feats[-1]), atol=LOGIT_TOL * float(
      jnp.abs(ref_feats[-1]).max()))


def test_float32_default_has_no_16_bit_op_and_explicit_options_match_it():
  """The default path lowers without any 16-bit op (its HLO equals the pre-mixed-precision model's, checked
  when the option was added), and naming the defaults changes nothing, bit for bit."""
  model, params = tiny_model()
  x = batches(1, 4)[0]
  text = jax.jit(lambda p, x: model.apply({"params": p}, x)).lower(params, x).as_text()
  assert "bf16" not in text and "f16" not in text
  explicit = create(TINY, dtype=compute_dtype("float32"), attention="matmul")
  np.testing.assert_array_equal(np.asarray(_apply(model, params, x)), np.asarray(_apply(explicit, params, x)))


def test_bf16_tent_step_keeps_params_and_optimizer_state_float32():
  model, params = tiny_model()
  xs = batches(2, 8, seed=5)
  runs = {}
  for name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
    ad = engine.Adapter(methods.get("tent"), model.clone(dtype=dtype), params, batch_size=8)
    state = ad.init_state()
    for x in xs:
      state, logits, metrics = ad.step(state, x)
    assert logits.dtype == jnp.float32 and bool(metrics["finite"])
    leaves = jax.tree.leaves((state.trainable, state.opt_state))
    assert leaves and all(l.dtype == jnp.float32 for l in leaves if jnp.issubdtype(l.dtype, jnp.floating))
    runs[name] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), state.trainable,
                              ad._initial.trainable)
  # The bf16 update points the same way as the float32 one.
  u32 = np.concatenate([u.ravel() for u in jax.tree.leaves(runs["float32"])])
  u16 = np.concatenate([u.ravel() for u in jax.tree.leaves(runs["bfloat16"])])
  cos = float(u32 @ u16 / (np.linalg.norm(u32) * np.linalg.norm(u16)))
  print(f"bf16 vs float32 TENT update: cosine {cos:.4f}")
  assert np.linalg.norm(u32) > 0 and cos > 0.95


def test_fused_attention_kernels():
  """'xla' computes the same attention as 'matmul'; 'cudnn' without a GPU warns and uses 'matmul'."""
  model, params = tiny_model()
  x = batches(1, 4)[0]
  ref = np.asarray(_apply(model, params, x))
  np.testing.assert_allclose(np.asarray(_apply(model.clone(attention="xla"), params, x)), ref, atol=1e-5)
  if jax.default_backend() != "gpu":
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = _apply(model.clone(attention="cudnn", dtype=jnp.bfloat16), params, x)
    assert any("using 'matmul'" in str(w.message) for w in caught)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_apply(model.clone(dtype=jnp.bfloat16), params, x)))
  with pytest.raises(UserError, match="attention"):
    _apply(model.clone(attention="flash"), params, x)
  with pytest.raises(UserError, match="--dtype"):
    compute_dtype("int8")


def test_even_length_padding_gives_the_unpadded_attention_and_gradients():
  """The odd-T padding that cuDNN's backward needs (`fused_attention(even_length=True)`), run with the 'xla'
  implementation (the same masking arithmetic, on any backend): same outputs and q/k/v gradients as unpadded."""
  from pcsr_jax.models.vit import fused_attention

  rng = np.random.default_rng(0)
  for t in (5, 6):  # odd: padded and masked; even: untouched
    q, k, v = (jnp.asarray(rng.standard_normal((2, t, 3, 8)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.standard_normal((2, t, 3, 8)), jnp.float32)
    loss = lambda q, k, v, even: jnp.sum(w * fused_attention(q, k, v, "xla", even_length=even))
    ref, ref_g = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    out, g = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, True)
    assert fused_attention(q, k, v, "xla", even_length=True).shape == (2, t, 3, 8)
    np.testing.assert_allclose(float(out), float(ref), rtol=1e-5)
    for a, b in zip(g, ref_g):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.torch
@pytest.mark.slow
def test_bf16_drift_on_the_parity_fixture(tmp_path, capsys):
  """`benchmarks/bf16_drift.py --arch`: the randomized timm fixture converts to float32 logits that match timm's,
  bf16 moves them measurably but within bf16's range, and the per-method rows are written."""
  import json

  from benchmarks import bf16_drift

  out = tmp_path / "drift.json"
  assert bf16_drift.main(["--arch", "vit_tiny_patch16_224", "--methods", "source,tent", "--batches", "2",
                          "--batch-size", "2", "--json", str(out)]) == 0
  res = json.loads(out.read_text())["results"]
  dist = res["timm_distance"]
  assert dist["float32"] < 1e-4 < dist["bfloat16"] < 0.1, dist
  for m in ("source", "tent"):
    rows = res[m]["logits"]
    assert len(rows) == 2 and all(1e-4 < d < 0.1 and 0.0 <= a <= 1.0 for d, a in rows), (m, rows)
  assert "parity fixture vit_tiny_patch16_224" in capsys.readouterr().out
