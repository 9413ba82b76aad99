"""Image ops on ``[..., H, W, C]`` float pixels in [0, 1], matching torchvision and PIL.

Every op takes scalar (possibly traced) parameters and broadcasts over leading batch axes, so one call
applies ONE draw to a whole batch (torchvision on a batch tensor), and ``jax.vmap`` over the parameters
gives one draw per sample. Formulas follow ``torchvision.transforms._functional_tensor`` (the tensor path
that CoTTA/ROID use), or PIL (``ImageOps``, ``Image.transform``) for the 8-bit ops of AugMix; the tests in
``tests/test_augment.py`` state the agreement reached with each.

Nothing here is covered by dm-pix or augmax with the same semantics: dm-pix follows ``tf.image`` (additive
brightness, per-channel contrast mean, HSV saturation, zero-padded blur), augmax uses its own invertible
colour curves; see ``pcsr_jax/augment/__init__.py``.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

_GRAY = (0.2989, 0.587, 0.114)  # torchvision rgb_to_grayscale (ITU-R 601-2, PIL's "L" conversion)


def normalize(x01: Array, mean: Sequence[float], std: Sequence[float]) -> Array:
  """[0, 1] pixels -> model input ``(x - mean) / std`` per channel (last axis)."""
  return (x01 - jnp.asarray(mean, x01.dtype)) / jnp.asarray(std, x01.dtype)


def denormalize(x: Array, mean: Sequence[float], std: Sequence[float]) -> Array:
  """Model input -> [0, 1] pixels, the inverse of :func:`normalize`."""
  return x * jnp.asarray(std, x.dtype) + jnp.asarray(mean, x.dtype)


# ---------------------------------------------------------------- colour (torchvision tensor formulas)

def grayscale(x: Array) -> Array:
  """Luma ``0.2989 R + 0.587 G + 0.114 B``, kept 3-channel (torchvision ``rgb_to_grayscale(img, 3)``)."""
  g = x[..., 0] * _GRAY[0] + x[..., 1] * _GRAY[1] + x[..., 2] * _GRAY[2]
  return jnp.broadcast_to(g[..., None], x.shape)


def _blend(a: Array, b: Array, ratio: Array) -> Array:
  return jnp.clip(ratio * a + (1.0 - ratio) * b, 0.0, 1.0)


def adjust_brightness(x: Array, factor: Array) -> Array:
  """``clamp(factor * x)`` (blend with black)."""
  return _blend(x, jnp.zeros_like(x), factor)


def adjust_contrast(x: Array, factor: Array) -> Array:
  """Blend with the image's mean luma; the mean is taken per image even when the factor is shared."""
  mean = jnp.mean(grayscale(x)[..., :1], axis=(-3, -2, -1), keepdims=True)
  return _blend(x, mean, factor)


def adjust_saturation(x: Array, factor: Array) -> Array:
  """Blend with the grayscale image."""
  return _blend(x, grayscale(x), factor)


def rgb_to_hsv(x: Array) -> Array:
  """torchvision ``_rgb2hsv`` (PIL's algorithm), ``[..., 3] -> [..., 3]`` with h in [0, 1)."""
  r, g, b = x[..., 0], x[..., 1], x[..., 2]
  maxc, minc = jnp.max(x, axis=-1), jnp.min(x, axis=-1)
  eqc = maxc == minc
  cr = maxc - minc
  s = cr / jnp.where(eqc, 1.0, maxc)
  div = jnp.where(eqc, 1.0, cr)
  rc, gc, bc = (maxc - r) / div, (maxc - g) / div, (maxc - b) / div
  h = jnp.where(maxc == r, bc - gc, jnp.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
  h = jnp.fmod(h / 6.0 + 1.0, 1.0)
  return jnp.stack([h, s, maxc], axis=-1)


def hsv_to_rgb(x: Array) -> Array:
  """torchvision ``_hsv2rgb``."""
  h, s, v = x[..., 0], x[..., 1], x[..., 2]
  i = jnp.floor(h * 6.0)
  f = h * 6.0 - i
  i = i.astype(jnp.int32) % 6
  p = jnp.clip(v * (1.0 - s), 0.0, 1.0)
  q = jnp.clip(v * (1.0 - s * f), 0.0, 1.0)
  t = jnp.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
  # A chain of selects, not ``jnp.choose``: choose is a gather whose indices carry the batch axis, which XLA's
  # partitioner cannot keep on each device's own rows (it gathered the indices of the whole batch to every
  # device and summed the outputs across them: ROID's step at ViT-S/16 batch 16 on 2 devices).
  sector = [i == k for k in range(6)]
  r = jnp.select(sector, [v, q, p, p, t, v])
  g = jnp.select(sector, [t, v, v, q, p, p])
  b = jnp.select(sector, [p, p, t, v, v, q])
  return jnp.stack([r, g, b], axis=-1)


def adjust_hue(x: Array, factor: Array) -> Array:
  """Rotate the hue by ``factor`` (a fraction of the circle, in [-0.5, 0.5])."""
  hsv = rgb_to_hsv(x)
  h = jnp.mod(hsv[..., 0] + factor, 1.0)
  return hsv_to_rgb(jnp.stack([h, hsv[..., 1], hsv[..., 2]], axis=-1))


def adjust_gamma(x: Array, gamma: Array, gain: float = 1.0) -> Array:
  """``clamp(gain * x ** gamma)``."""
  return jnp.clip(gain * jnp.power(x, gamma), 0.0, 1.0)


# ---------------------------------------------------------------- filtering and geometry (torchvision)

def gaussian_kernel1d(kernel_size: int, sigma: Array) -> Array:
  """torchvision's kernel: ``exp(-x^2 / 2 sigma^2)`` at integer offsets, normalised to sum 1."""
  half = (kernel_size - 1) * 0.5
  t = jnp.linspace(-half, half, kernel_size)
  pdf = jnp.exp(-0.5 * (t / sigma) ** 2)
  return pdf / jnp.sum(pdf)


def _sep_conv(x: Array, k: Array, axis: int) -> Array:
  """Valid 1-D correlation of ``x`` with kernel ``k`` along spatial ``axis`` (-3 rows or -2 columns)."""
  n = k.shape[0]
  size = x.shape[axis] - n + 1
  out = 0.0
  for i in range(n):
    out = out + k[i] * jax.lax.slice_in_dim(x, i, i + size, axis=x.ndim + axis)
  return out


def gaussian_blur(x: Array, kernel_size: int, sigma: Array, padding: str = "reflect") -> Array:
  """torchvision ``gaussian_blur``: separable Gaussian, ``reflect`` padding by ``kernel_size // 2``.

  ``padding="valid"`` skips the padding (the output shrinks by ``kernel_size - 1``).
  """
  k = gaussian_kernel1d(kernel_size, sigma)
  if padding != "valid":
    r = kernel_size // 2
    pad = [(0, 0)] * (x.ndim - 3) + [(r, r), (r, r), (0, 0)]
    x = jnp.pad(x, pad, mode=padding)
  return _sep_conv(_sep_conv(x, k, -3), k, -2)


def hflip(x: Array) -> Array:
  return x[..., ::-1, :]


def pad(x: Array, p: int, mode: str) -> Array:
  """torchvision ``Pad(p, padding_mode)``: ``edge`` / ``reflect`` (no edge repeat) / ``constant`` (0)."""
  widths = [(0, 0)] * (x.ndim - 3) + [(p, p), (p, p), (0, 0)]
  return jnp.pad(x, widths, mode=mode)


def _sample_bilinear(img: Array, ys: Array, xs: Array, mode: str = "constant", cval: float = 0.0) -> Array:
  """Bilinear samples of one ``[H, W, C]`` image at pixel-index coordinates ``ys, xs`` (``[h, w]``).

  ``constant``: neighbours outside the image count as ``cval`` (``grid_sample(padding_mode="zeros")``,
  ``map_coordinates(mode="constant")``); ``nearest``: neighbours are clamped to the edge. Gathering
  whole pixels (all channels at once) is what makes this cheaper than ``jax.scipy.ndimage``.
  """
  h, w = img.shape[0], img.shape[1]
  y0, x0 = jnp.floor(ys), jnp.floor(xs)
  dy, dx = ys - y0, xs - x0
  y0, x0 = y0.astype(jnp.int32), x0.astype(jnp.int32)
  out = 0.0
  for oy, wy in ((0, 1.0 - dy), (1, dy)):
    for ox, wx in ((0, 1.0 - dx), (1, dx)):
      yi, xi = y0 + oy, x0 + ox
      v = img[jnp.clip(yi, 0, h - 1), jnp.clip(xi, 0, w - 1)]
      if mode == "constant":
        v = jnp.where(((yi >= 0) & (yi < h) & (xi >= 0) & (xi < w))[..., None], v, cval)
      out = out + (wy * wx)[..., None] * v
  return out


def affine_tv(img: Array, angle: Array, translate: tuple[Array, Array], scale: Array,
              out_rows: tuple[int, int] | None = None) -> Array:
  """torchvision ``F.affine`` on a tensor (no shear, centre of the image, bilinear, zero fill).

  Output pixel ``o`` (relative to the image centre ``(W-1)/2, (H-1)/2``) samples the input at
  ``R(angle)^-1 (o - t) / scale``, as ``grid_sample(align_corners=False, padding_mode="zeros")``.
  ``angle`` in degrees (torchvision's sign), ``translate = (tx, ty)`` in pixels. ``out_rows=(start, size)``
  computes only the square window ``[start, start + size)`` of the output in both axes, which is exact
  and saves work when a centre crop follows. ``img`` is one ``[H, W, C]`` image.
  """
  h, w = img.shape[-3], img.shape[-2]
  start, size = (0, h) if out_rows is None else out_rows
  rot = jnp.deg2rad(angle)
  cos, sin = jnp.cos(rot), jnp.sin(rot)
  oy = jnp.arange(start, start + size, dtype=jnp.float32) - (h - 1) * 0.5 - translate[1]
  ox = jnp.arange(start, start + size, dtype=jnp.float32) - (w - 1) * 0.5 - translate[0]
  oy, ox = oy[:, None], ox[None, :]
  xs = (cos * ox + sin * oy) / scale + (w - 1) * 0.5
  ys = (-sin * ox + cos * oy) / scale + (h - 1) * 0.5
  return _sample_bilinear(img, ys, xs)


# ---------------------------------------------------------------- PIL 8-bit ops (AugMix)

def quantize(x01: Array) -> Array:
  """[0, 1] floats -> the 8-bit levels 0..255 (as float32), rounding half up as ``ToPILImage`` does."""
  return jnp.clip(jnp.floor(x01 * 255.0 + 0.5), 0.0, 255.0)


def autocontrast(q: Array) -> Array:
  """PIL ``ImageOps.autocontrast(cutoff=0)`` on 8-bit levels ``[H, W, C]``: stretch each channel to 0..255."""
  lo = jnp.min(q, axis=(-3, -2), keepdims=True)
  hi = jnp.max(q, axis=(-3, -2), keepdims=True)
  scale = 255.0 / jnp.where(hi > lo, hi - lo, 1.0)
  # PIL evaluates int(ix * scale - lo * scale) in float64; the 1e-3 keeps exact integers (the top level
  # maps to 255) from landing just below in float32.
  out = jnp.clip(jnp.floor(q * scale - lo * scale + 1e-3), 0.0, 255.0)
  return jnp.where(hi > lo, out, q)


def equalize(q: Array) -> Array:
  """PIL ``ImageOps.equalize`` on 8-bit levels ``[H, W, C]`` (per-channel histogram equalisation)."""
  def one(ch):
    idx = ch.astype(jnp.int32).reshape(-1)
    h = jnp.zeros(256, jnp.int32).at[idx].add(1)
    last = h[jnp.max(jnp.where(h > 0, jnp.arange(256), -1))]  # count of the highest used level
    step = (idx.shape[0] - last) // 255
    n = step // 2 + jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(h)[:-1]])
    lut = jnp.minimum(n // jnp.maximum(step, 1), 255)
    return jnp.where(step > 0, lut[idx].reshape(ch.shape).astype(q.dtype), ch)
  return jnp.moveaxis(jax.vmap(one, in_axes=-1)(q), 0, -1)


def solarize(q: Array, threshold: Array) -> Array:
  """PIL ``ImageOps.solarize``: invert the levels at or above ``threshold``."""
  return jnp.where(q < threshold, q, 255.0 - q)


def posterize(q: Array, bits: int) -> Array:
  """PIL ``ImageOps.posterize``: keep the top ``bits`` bits of each level."""
  m = 2.0 ** (8 - bits)
  return jnp.floor(q / m) * m


def affine_pil(q: Array, coeffs: Array, fill: Sequence[float] = (128.0, 0.0, 0.0)) -> Array:
  """PIL ``Image.transform(size, AFFINE, coeffs, BILINEAR, fillcolor=fill)`` on 8-bit levels ``[H, W, C]``.

  Output pixel centre ``(x + .5, y + .5)`` maps to input ``(a x + b y + c, d x + e y + f)``; a point outside
  ``[0, W) x [0, H)`` gets ``fill``, inside it is interpolated with edge-clamped neighbours and rounded.
  AugMix passes ``fillcolor=128``, which PIL reads for an RGB image as the packed colour (128, 0, 0).
  """
  h, w = q.shape[-3], q.shape[-2]
  a, b, c, d, e, f = (coeffs[i] for i in range(6))
  yo = jnp.arange(h, dtype=jnp.float32)[:, None] + 0.5
  xo = jnp.arange(w, dtype=jnp.float32)[None, :] + 0.5
  xi = a * xo + b * yo + c
  yi = d * xo + e * yo + f
  inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
  v = _sample_bilinear(q, yi - 0.5, xi - 0.5, mode="nearest")
  # PIL truncates the interpolated value ((UINT8) v in Geometry.c); the 1e-3 absorbs float32 error.
  return jnp.where(inside[..., None], jnp.clip(jnp.floor(v + 1e-3), 0.0, 255.0), jnp.asarray(fill, q.dtype))


def rotate_pil_coeffs(degrees: Array, h: int, w: int, xp=jnp) -> Array:
  """The inverse affine coefficients of PIL ``Image.rotate(degrees)`` about the image centre (``xp``: the
  array module, ``numpy`` for float64 constants)."""
  t = -xp.deg2rad(degrees)
  cos, sin = xp.cos(t), xp.sin(t)
  cx, cy = w / 2.0, h / 2.0
  return xp.stack([cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy])


# ---------------------------------------------------------------- resampling (PIL bilinear resize)

def _pil_bilinear_weights(out_size: int, in_size: int, start: Array, length: Array) -> Array:
  """``[out_size, in_size]`` weights of PIL's bilinear resize of the window ``[start, start+length)``.

  PIL scales the triangle filter's support by the downscale factor (antialiasing) and renormalises
  over the taps inside the window, which is what a crop-then-resize does at the crop's edges.
  """
  length = length.astype(jnp.float32)
  ratio = length / out_size
  support = jnp.maximum(ratio, 1.0)
  centre = (jnp.arange(out_size, dtype=jnp.float32) + 0.5) * ratio
  i = jnp.arange(in_size, dtype=jnp.float32) - start
  wts = jnp.maximum(0.0, 1.0 - jnp.abs((i[None, :] + 0.5 - centre[:, None]) / support))
  wts = jnp.where((i[None, :] >= 0) & (i[None, :] < length), wts, 0.0)
  return wts / jnp.sum(wts, axis=1, keepdims=True)


def resized_crop(img: Array, top: Array, left: Array, height: Array, width: Array, size: int) -> Array:
  """Crop ``[top, top+height) x [left, left+width)`` of one ``[H, W, C]`` image and resize it to
  ``size x size`` with PIL's antialiased bilinear filter (torchvision ``RandomResizedCrop`` on a PIL image),
  with traced box coordinates and a fixed output shape. Returns 8-bit levels: like PIL, the horizontal
  pass is rounded to 8 bits before the vertical one."""
  wy = _pil_bilinear_weights(size, img.shape[0], top, height)
  wx = _pil_bilinear_weights(size, img.shape[1], left, width)
  hp = jax.lax.Precision.HIGHEST
  rows = quantize(jnp.einsum("pw,hwc->hpc", wx, img, precision=hp))
  return jnp.clip(jnp.floor(jnp.einsum("oh,hpc->opc", wy, rows, precision=hp) + 0.5), 0.0, 255.0)


def random_resized_crop_box(key: Array, h: int, w: int, scale=(0.08, 1.0),
                            ratio=(3.0 / 4.0, 4.0 / 3.0)) -> tuple[Array, Array, Array, Array]:
  """torchvision ``RandomResizedCrop.get_params``: up to 10 tries of (area, log-uniform aspect), the
  first that fits wins; otherwise the centre crop with the aspect clamped to ``ratio``."""
  k_area, k_ratio, k_i, k_j = jax.random.split(key, 4)
  area = h * w
  target = area * jax.random.uniform(k_area, (10,), minval=scale[0], maxval=scale[1])
  aspect = jnp.exp(jax.random.uniform(k_ratio, (10,), minval=math.log(ratio[0]), maxval=math.log(ratio[1])))
  cw = jnp.round(jnp.sqrt(target * aspect))
  ch = jnp.round(jnp.sqrt(target / aspect))
  ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
  first = jnp.argmax(ok)
  in_ratio = w / h
  if in_ratio < ratio[0]:
    fw, fh = w, round(w / ratio[0])
  elif in_ratio > ratio[1]:
    fh, fw = h, round(h * ratio[1])
  else:
    fw, fh = w, h
  found = jnp.any(ok)
  ch = jnp.where(found, ch[first], fh)
  cw = jnp.where(found, cw[first], fw)
  top = jnp.where(found, jnp.floor(jax.random.uniform(k_i) * (h - ch + 1)), (h - fh) // 2)
  left = jnp.where(found, jnp.floor(jax.random.uniform(k_j) * (w - cw + 1)), (w - fw) // 2)
  return top, left, ch, cw
