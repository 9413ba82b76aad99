"""The ViT's LayerNorm, GELU, softmax attention and patch convolution with hand-written VJPs, for speed on
XLA:CPU.

LayerNorm and GELU compute exactly what they replace in the forward (the same jnp expressions, so the same
float32 values: flax's ``nn.LayerNorm`` and torch's exact GELU); only their backward is written by hand, as
the closed forms PyTorch's own kernels use (``native_layer_norm_backward``, ``gelu_backward``). The attention
normalizes its softmax after the ``A V`` product (as flash attention does), which rounds differently from
``softmax(s) @ v`` by float32 ulps, and has the softmax's closed-form backward. The patch convolution is
``nn.Conv``'s forward with its kernel gradient as one matmul over the patches.

Why: XLA differentiates a forward op by op, and on the CPU the result costs memory passes over full
activations that a closed form does not need. For LayerNorm it materializes ``rsqrt(var) * scale``
broadcast to ``[B, T, D]`` for its reductions, twice per LayerNorm; for GELU it stores
``0.5 * (1 + erf(x / sqrt 2))`` as a second ``[B, T, 4D]`` activation; for the softmax it divides every
score and computes ``exp`` twice. Per ViT-S/16 TENT step (batch 16, 2 cores; `benchmarks/profile_step.py
--method tent`): attention 482 -> 327 ms, "other" (LayerNorm, residuals, layout copies) 432 -> 200 ms.

Where: a CPU only. Each op takes ``closed_form`` (the model's ``cpu_ops``, set from the platform the step is
built for: `pcsr_jax.platforms`); False gives the same forward expression differentiated by XLA, whose own
fusions on a GPU or TPU need none of this (and no optimization barrier). The closed forms run inside the named
scope `CLOSED_FORM_SCOPE`, so a lowered program shows whether it holds one (`tests/test_lowering.py`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any

_SQRT1_2 = 0.7071067811865476  # M_SQRT1_2, as torch's GELU multiplies by it
_PDF_SCALE = 0.5 * 1.1283791670955126 * _SQRT1_2  # torch's kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5 = 1/sqrt(2 pi)
CLOSED_FORM_SCOPE = "cpu_closed_form"  # the named scope of every hand-written VJP below


def gelu(x: Array, closed_form: bool = True) -> Array:
  """Exact GELU in torch's own form, ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (flax's default is the tanh
  approximation). Not ``jax.nn.gelu(approximate=False)``, whose ``erfc`` XLA:CPU expands into both of its
  branches plus an exponential: the ``erf`` form computes the same function (within 1.5e-6 of torch either
  way) 2.5x faster forward. ``closed_form``: the backward is torch's ``gelu_backward``,
  ``dy * (cdf(x) + x * pdf(x))``; else XLA's of the same expression."""
  if not closed_form:
    return _gelu(x)
  with jax.named_scope(CLOSED_FORM_SCOPE):
    return _gelu_closed(x)


def _gelu(x: Array) -> Array:
  return x * 0.5 * (1.0 + jax.lax.erf(x * _SQRT1_2))


_gelu_closed = jax.custom_vjp(_gelu)


def _gelu_fwd(x: Array) -> tuple[Array, Array]:
  return _gelu(x), x


def _gelu_bwd(x: Array, dy: Array) -> tuple[Array]:
  # The barrier keeps XLA from sharing erf(x) with the forward: shared, it would be stored as one more
  # [B, T, 4D] activation (a write and a read) instead of recomputed inside this fusion.
  xf = jax.lax.optimization_barrier(x).astype(jnp.float32)
  cdf = 0.5 * (1.0 + jax.lax.erf(xf * _SQRT1_2))
  pdf = jnp.exp(-0.5 * xf * xf) * _PDF_SCALE
  return ((dy.astype(jnp.float32) * (cdf + xf * pdf)).astype(dy.dtype),)


_gelu_closed.defvjp(_gelu_fwd, _gelu_bwd)


def _stats(x: Array) -> tuple[Array, Array]:
  """Mean and variance over the last axis, as flax's LayerNorm (fast variance, clipped at 0)."""
  mu = x.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, (x * x).mean(-1, keepdims=True) - mu * mu)
  return mu, var


def layer_norm(x: Array, scale: Array, bias: Array, eps: float, closed_form: bool = True) -> Array:
  """LayerNorm over the last axis of float32 ``x``, computed as flax's ``nn.LayerNorm`` computes it:
  ``(x - mean) * (rsqrt(var + eps) * scale) + bias`` with ``var = E[x^2] - E[x]^2``; ``closed_form``: with
  PyTorch's closed-form backward, else XLA's."""
  if not closed_form:
    return _ln_fwd(x, scale, bias, eps)[0]
  with jax.named_scope(CLOSED_FORM_SCOPE):
    return _layer_norm_closed(x, scale, bias, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))  # eps: a Python float
def _layer_norm_closed(x: Array, scale: Array, bias: Array, eps: float) -> Array:
  return _ln_fwd(x, scale, bias, eps)[0]


def _ln_fwd(x, scale, bias, eps):
  mu, var = _stats(x)
  r = jax.lax.rsqrt(var + eps)
  return (x - mu) * (r * scale) + bias, (x, mu, r, scale)


def _ln_bwd(eps, res, dy):
  # With xhat = (x - mean) * r and g = dy * scale (PyTorch's native_layer_norm_backward):
  #   dx = r * (g - mean(g) - xhat * mean(g * xhat)),  dscale = sum(dy * xhat),  dbias = sum(dy)
  # over the rows; no [B, T, D] tensor but dx is written, the rest fuses into two passes over dy.
  x, mu, r, scale = res
  xhat = (x - mu) * r
  g = dy * scale
  dx = r * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
  rows = tuple(range(x.ndim - 1))
  return dx, (dy * xhat).sum(rows), dy.sum(rows)


_layer_norm_closed.defvjp(_ln_fwd, _ln_bwd)


class LayerNorm(nn.Module):
  """``nn.LayerNorm`` over the last axis with the same params (``scale``, ``bias``), the same float32
  statistics and values, and `layer_norm`'s hand-written backward. ``dtype``: the output's dtype (None:
  float32); the input is normalized in float32 whatever its dtype, as flax does."""

  epsilon: float = 1e-6
  dtype: Optional[Dtype] = None
  closed_form: bool = True  # the hand-written backward (a CPU's); False: XLA's

  @nn.compact
  def __call__(self, x: Array) -> Array:
    d = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
    y = layer_norm(x.astype(jnp.float32), scale, bias, self.epsilon, self.closed_form)
    return y if self.dtype is None else y.astype(self.dtype)


def softmax_attention(q: Array, k: Array, v: Array, closed_form: bool = True) -> Array:
  """``softmax(q k^T) v`` over ``[..., T, Dh]`` inputs (q already scaled): with ``closed_form``
  `_softmax_attention_closed`, else the softmax normalized before the product (float32 scores and softmax,
  the products in the inputs' dtype), differentiated by XLA."""
  if closed_form:
    with jax.named_scope(CLOSED_FORM_SCOPE):
      return _softmax_attention_closed(q, k, v)
  s = jnp.matmul(q, jnp.swapaxes(k, -1, -2)).astype(jnp.float32)
  return jnp.matmul(jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


@jax.custom_vjp
def _softmax_attention_closed(q: Array, k: Array, v: Array) -> Array:
  """``softmax(q k^T) v`` over ``[..., T, Dh]`` inputs (q already scaled), with a hand-written backward.

  The softmax is normalized after the ``A V`` product, ``(exp(s - max) v) / sum(exp(s - max))``, as flash
  attention does: one division per output element instead of one per score. The backward keeps the
  unnormalized ``exp(s - max)`` and the row sums and uses the closed form ``dS = P * (dP - rowsum(dO * O))``
  with the ``1 / sum`` folded into ``dO``, so each ``T x T`` tensor is read or written a few times less than
  by autodiff of the softmax. Scores, exponentials and sums are float32 whatever the inputs' dtype; the
  products run in the inputs' dtype."""
  return _attention_fwd(q, k, v)[0]


def _attention_fwd(q, k, v):
  s = jnp.matmul(q, jnp.swapaxes(k, -1, -2)).astype(jnp.float32)
  e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
  l = e.sum(-1, keepdims=True)
  e = e.astype(v.dtype)
  o = (jnp.matmul(e, v).astype(jnp.float32) / l).astype(v.dtype)
  return o, (q, k, v, e, l, o)


def _attention_bwd(res, do):
  q, k, v, e, l, o = res
  dol = do.astype(jnp.float32) / l  # dO / sum: P = e / sum, so dV = e^T (dO / sum) and dP / sum = (dO / sum) V^T
  delta = (dol * o.astype(jnp.float32)).sum(-1, keepdims=True)  # rowsum(dO * O) / sum
  dol = dol.astype(v.dtype)
  dv = jnp.matmul(jnp.swapaxes(e, -1, -2), dol)
  ds = (e.astype(jnp.float32) * (jnp.matmul(dol, jnp.swapaxes(v, -1, -2)).astype(jnp.float32) - delta)
        ).astype(q.dtype)  # = P * (dP - rowsum(dO * O)), the softmax's VJP
  return jnp.matmul(ds, k), jnp.matmul(jnp.swapaxes(ds, -1, -2), q), dv


_softmax_attention_closed.defvjp(_attention_fwd, _attention_bwd)


def _patch_conv(x: Array, kernel: Array) -> Array:
  p, q = kernel.shape[:2]
  return jax.lax.conv_general_dilated(x, kernel, (p, q), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def patch_conv(x: Array, kernel: Array, closed_form: bool = True) -> Array:
  """`_patch_conv_closed` (``closed_form``), else the same convolution differentiated by XLA."""
  if not closed_form:
    return _patch_conv(x, kernel)
  with jax.named_scope(CLOSED_FORM_SCOPE):
    return _patch_conv_closed(x, kernel)


@jax.custom_vjp
def _patch_conv_closed(x: Array, kernel: Array) -> Array:
  """The patch embedding's convolution: ``[B, H, W, C]`` images, a ``[p, q, C, D]`` kernel with stride
  ``(p, q)`` and no padding -> ``[B, H // p, W // q, D]``, the forward exactly as ``nn.Conv`` computes it.

  The backward is two matmuls over non-overlapping patches: ``dK[p, q, c, d] = sum over (b, h, w) of
  patch[b, h, w, p, q, c] * dY[b, h, w, d]`` and ``dX`` its transpose. XLA:CPU's convolution backward for the
  kernel took 9.8 s of a MEMO step's 25.8 s at ViT-S/16 with 64 views (`python -m benchmarks.profile_step --method
  memo --batch-size 1`; 0.16 s with this VJP). The steps of AdaContrast and CoTTA, which also train the patch
  embedding, did not change measurably at batch 16."""
  return _patch_conv(x, kernel)


def _patch_conv_fwd(x, kernel):
  return _patch_conv(x, kernel), (x, kernel)


def _patch_conv_bwd(res, dy):
  x, kernel = res
  p, q, c, _ = kernel.shape
  b, h, w, _ = dy.shape
  patches = x[:, :h * p, :w * q].reshape(b, h, p, w, q, c)  # rows/columns past the last whole patch: unused
  dk = jnp.einsum("bhpwqc,bhwd->pqcd", patches, dy)
  dx = jnp.einsum("bhwd,pqcd->bhpwqc", dy, kernel).reshape(b, h * p, w * q, c)
  dx = jnp.pad(dx, ((0, 0), (0, x.shape[1] - h * p), (0, x.shape[2] - w * q), (0, 0)))
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_patch_conv_closed.defvjp(_patch_conv_fwd, _patch_conv_bwd)


class PatchConv(nn.Module):
  """``nn.Conv(features, (p, p), strides=(p, p), padding="VALID")`` with the same params (``kernel``,
  ``bias``), initializers, forward values and dtype handling, and `patch_conv`'s backward."""

  features: int
  patch_size: int
  dtype: Optional[Dtype] = None
  closed_form: bool = True  # the hand-written backward (a CPU's); False: XLA's

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = self.patch_size
    shape = (p, p, x.shape[-1], self.features)
    kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, jnp.float32)
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    return patch_conv(x, kernel, self.closed_form) + bias
