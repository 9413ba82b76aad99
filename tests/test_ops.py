"""The hand-written VJPs of `pcsr_jax.models.ops` against autodiff of the plain formulas they replace.

Forward values are compared exactly where the op computes the same expression (LayerNorm, GELU: same
machine, same run); gradients and the attention (normalized after ``A V``) within float32 rounding.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax.models import ops


def _rand(key, *shapes, scale=1.0):
  keys = jax.random.split(jax.random.key(key), len(shapes))
  return [scale * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_layer_norm_matches_flax_values_and_gradients():
  x, dy, scale = _rand(0, (3, 9, 48), (3, 9, 48), (48,))
  x = 3.0 * x + 1.5  # an offset mean, as the residual stream has
  params = {"params": {"scale": scale, "bias": jnp.linspace(-1, 1, 48)}}
  ref, mine = nn.LayerNorm(epsilon=1e-6), ops.LayerNorm(epsilon=1e-6)
  assert jax.tree.structure(ref.init(jax.random.key(1), x)) == jax.tree.structure(mine.init(jax.random.key(1), x))
  y_ref, y = jax.jit(ref.apply)(params, x), jax.jit(mine.apply)(params, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))  # the same expression: the same floats

  def grads(m):
    return jax.jit(jax.grad(lambda p, x: (m.apply(p, x) * dy).sum(), argnums=(0, 1)))(params, x)

  (gp_ref, gx_ref), (gp, gx) = grads(ref), grads(mine)
  assert _rel(gx, gx_ref) < 1e-5
  for name in ("scale", "bias"):
    assert _rel(gp["params"][name], gp_ref["params"][name]) < 1e-5, name


def test_layer_norm_output_dtype_and_float32_statistics():
  x = (_rand(2, (2, 5, 32))[0] * 4 + 100.0).astype(jnp.bfloat16)  # a large mean: bf16 statistics would lose it
  p = {"params": {"scale": jnp.ones(32), "bias": jnp.zeros(32)}}
  y = ops.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16).apply(p, x)
  y_ref = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16).apply(p, x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  g = jax.grad(lambda x: ops.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16).apply(p, x).astype(jnp.float32).sum())(x)
  assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()


def test_gelu_is_exact_gelu_with_its_derivative():
  z = jnp.linspace(-9.0, 9.0, 2001)
  exact = jax.nn.gelu(z, approximate=False)
  assert float(jnp.abs(ops.gelu(z) - exact).max()) < 2e-6
  d = jax.vmap(jax.grad(ops.gelu))(z)
  d_ref = jax.vmap(jax.grad(lambda t: jax.nn.gelu(t, approximate=False)))(z)
  assert float(jnp.abs(d - d_ref).max()) < 1e-6
  # and the closed form itself: d/dx [x Phi(x)] = Phi(x) + x phi(x)
  phi = jnp.exp(-0.5 * z * z) / jnp.sqrt(2 * jnp.pi)
  cdf = 0.5 * (1 + jax.lax.erf(z / jnp.sqrt(2.0)))
  assert float(jnp.abs(d - (cdf + z * phi)).max()) < 1e-6


def _attention_ref(q, k, v):
  return jnp.matmul(jax.nn.softmax(jnp.matmul(q, jnp.swapaxes(k, -1, -2)), axis=-1), v)


@pytest.mark.parametrize("tokens", [7, 50])
def test_softmax_attention_matches_autodiff(tokens):
  q, k, v, do = _rand(3, *[(2, 3, tokens, 16)] * 4)
  q = q * 16**-0.5 * 4  # peaked attention rows
  out, vjp = jax.vjp(jax.jit(ops.softmax_attention), q, k, v)
  out_ref, vjp_ref = jax.vjp(_attention_ref, q, k, v)
  assert _rel(out, out_ref) < 1e-5
  for g, g_ref in zip(vjp(do), vjp_ref(do)):
    assert _rel(g, g_ref) < 1e-5


def test_softmax_attention_large_scores_stay_finite():
  q, k, v, do = _rand(4, *[(1, 2, 9, 8)] * 4)
  q = q * 1e3  # scores of order 1e3: exp overflows without the max subtraction
  out, vjp = jax.vjp(ops.softmax_attention, q, k, v)
  grads = vjp(do)
  assert np.isfinite(np.asarray(out)).all() and all(np.isfinite(np.asarray(g)).all() for g in grads)
  assert _rel(out, _attention_ref(q, k, v)) < 1e-5


def test_softmax_attention_bf16_close_to_float32():
  q, k, v, do = _rand(5, *[(2, 2, 20, 16)] * 4)
  q = q * 0.25
  args16 = [t.astype(jnp.bfloat16) for t in (q, k, v)]
  out16, vjp16 = jax.vjp(ops.softmax_attention, *args16)
  assert out16.dtype == jnp.bfloat16
  ref, vjp_ref = jax.vjp(_attention_ref, *[t.astype(jnp.float32) for t in args16])
  assert _rel(out16, ref) < 2e-2  # bf16 products, float32 softmax
  for g, g_ref in zip(vjp16(do.astype(jnp.bfloat16)), vjp_ref(do)):
    assert g.dtype == jnp.bfloat16 and _rel(g, g_ref) < 5e-2


@pytest.mark.parametrize("hw", [(16, 12), (18, 21)])  # whole patches; rows and columns past the last patch
def test_patch_conv_matches_nn_conv_values_and_gradients(hw):
  x, dy_full = _rand(3, (2, *hw, 3), (2, hw[0] // 4, hw[1] // 4, 8))
  ref, mine = nn.Conv(8, (4, 4), strides=(4, 4), padding="VALID"), ops.PatchConv(8, 4)
  p_ref, p_mine = ref.init(jax.random.key(4), x), mine.init(jax.random.key(4), x)
  assert jax.tree.structure(p_ref) == jax.tree.structure(p_mine)
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_mine)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same initializers and draws
  params = {"params": {"kernel": _rand(5, (4, 4, 3, 8))[0], "bias": jnp.linspace(-1, 1, 8)}}
  y_ref, y = jax.jit(ref.apply)(params, x), jax.jit(mine.apply)(params, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))  # the same convolution: the same floats

  def grads(m):
    return jax.jit(jax.grad(lambda p, x: (m.apply(p, x) * dy_full).sum(), argnums=(0, 1)))(params, x)

  (gp_ref, gx_ref), (gp, gx) = grads(ref), grads(mine)
  assert gx.shape == x.shape and _rel(gx, gx_ref) < 1e-5
  if hw[0] % 4:  # the rows past the last whole patch reach no output
    assert float(jnp.abs(gx[:, hw[0] // 4 * 4:]).max()) == 0.0
  for name in ("kernel", "bias"):
    assert _rel(gp["params"][name], gp_ref["params"][name]) < 1e-5, name


def test_patch_conv_bf16_dtype_and_float32_param_gradients():
  x = _rand(6, (2, 8, 8, 3))[0]
  m = ops.PatchConv(4, 4, dtype=jnp.bfloat16)
  p = m.init(jax.random.key(0), x)
  y = m.apply(p, x)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 2, 2, 4)
  g = jax.grad(lambda p: m.apply(p, x).astype(jnp.float32).sum())(p)
  ref = jax.grad(lambda p: nn.Conv(4, (4, 4), strides=(4, 4), padding="VALID", dtype=jnp.bfloat16).apply(
      p, x).astype(jnp.float32).sum())(p)
  assert g["params"]["kernel"].dtype == jnp.float32
  assert _rel(g["params"]["kernel"], ref["params"]["kernel"]) < 1e-2  # bf16 products, rounded differently


def test_the_xla_forms_equal_the_closed_forms_op_by_op():
  """``closed_form=False`` (a GPU's or TPU's step: `vit.for_platform`) is the same forward expression
  differentiated by XLA: the values equal the closed forms' (the attention within float32 ulps: it normalizes
  before the product), the gradients within float32 rounding, and no op runs under `ops.CLOSED_FORM_SCOPE`."""
  x, dy = _rand(7, (2, 5, 16), (2, 5, 16))
  scale, bias = _rand(8, (16,), (16,))
  for f in (lambda x, cf: ops.gelu(x, cf), lambda x, cf: ops.layer_norm(x, scale, bias, 1e-6, cf)):
    (y1, vjp1), (y0, vjp0) = (jax.vjp(lambda x: f(x, cf), x) for cf in (True, False))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    assert _rel(vjp0(dy)[0], vjp1(dy)[0]) < 1e-5
  q, k, v, do = _rand(9, (2, 3, 7, 8), (2, 3, 7, 8), (2, 3, 7, 8), (2, 3, 7, 8))
  (o1, vjp1), (o0, vjp0) = (jax.vjp(lambda *a: ops.softmax_attention(*a, closed_form=cf), q, k, v)
                            for cf in (True, False))
  assert _rel(o0, o1) < 1e-6
  for g0, g1 in zip(vjp0(do), vjp1(do)):
    assert _rel(g0, g1) < 1e-5
  img, kernel = _rand(10, (2, 8, 8, 3), (4, 4, 3, 6))
  (c1, vjp1), (c0, vjp0) = (jax.vjp(lambda a, b: ops.patch_conv(a, b, cf), img, kernel) for cf in (True, False))
  np.testing.assert_array_equal(np.asarray(c1), np.asarray(c0))
  dc = _rand(11, c1.shape)[0]
  for g0, g1 in zip(vjp0(dc), vjp1(dc)):
    assert _rel(g0, g1) < 1e-5
  text = jax.jit(lambda x: ops.gelu(x, False)).lower(x).as_text(debug_info=True)
  assert ops.CLOSED_FORM_SCOPE not in text
  assert ops.CLOSED_FORM_SCOPE in jax.jit(lambda x: ops.gelu(x, True)).lower(x).as_text(debug_info=True)


def test_a_vit_for_a_gpu_or_tpu_has_the_cpu_models_logits_and_gradients():
  """`vit.for_platform`: off a CPU the ViT runs XLA's backward passes and the resolved attention kernel
  (`vit.attention_for`); its logits and parameter gradients are the CPU model's within float32 rounding
  (relative 1e-5 on logits, 1e-4 on gradients: BLAS sums in another order on another machine stay well
  inside them)."""
  from pcsr_jax.models import vit
  from tiny import tiny_model

  model, params = tiny_model()
  x = _rand(12, (4, 32, 32, 3))[0]
  assert vit.attention_for("auto", "cpu") == "matmul" and vit.attention_for("auto", "tpu") == "xla"
  assert vit.attention_for("auto", "gpu") == "xla" and vit.attention_for("auto", "gpu", jnp.bfloat16) == "cudnn"
  assert vit.attention_for("matmul", "gpu", jnp.bfloat16) == "matmul"  # a kernel named is kept
  cpu = vit.for_platform(model.clone(attention="auto"), "cpu")
  assert (cpu.attention, cpu.cpu_ops) == ("matmul", True)
  out = {}
  for name, m in (("cpu", cpu), ("tpu", vit.for_platform(model.clone(attention="auto"), "tpu")),
                  ("gpu-matmul", vit.for_platform(model, "gpu"))):
    loss = lambda p, m=m: jnp.sum(jax.nn.log_softmax(m.apply({"params": p}, x)) ** 2)
    out[name] = (m.apply({"params": params}, x), jax.grad(loss)(params))
  assert vit.for_platform(model, "tpu").cpu_ops is False
  for name in ("tpu", "gpu-matmul"):
    assert _rel(out[name][0], out["cpu"][0]) < 1e-5, name
    for a, b in zip(jax.tree.leaves(out[name][1]), jax.tree.leaves(out["cpu"][1])):
      assert _rel(a, b) < 1e-4, name
  with pytest.raises(Exception, match=r"attention='auto' names a kernel per platform"):
    model.clone(attention="auto").apply({"params": params}, x)
