"""SPA's two learnable-strength views (``mr-eggplant/SPA:tta_library/spa.py`` ``Prompt.masking``,
``models/maskers.py`` ``LearnablePatchErasing``), on NORMALISED images ``[B, H, W, C]`` as in SPA, which
applies both to the model input (mean = std = 0.5, so pixels span [-1, 1])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def low_frequency_block(size: int, ratio: float = 0.2) -> tuple[int, int]:
  """(start, length) of SPA's central block on the fftshifted spectrum: length ``int(size * ratio)``
  (at least 1), placed as ``F.pad(ones, [size - pad - length, pad])`` with ``pad = (size - length) // 2``."""
  length = max(int(size * ratio), 1)
  pad = (size - length) // 2
  return size - pad - length, length


def _symmetric(mask: Array) -> Array:
  """SPA's ``__convert_symmertry_mask`` on ``[B, H, W, C]`` fftshifted masks: on the odd-sized
  sub-grid (drop the first row/column for even sizes) the lower half and the left half of the middle
  row are set to 1, then the grid is multiplied by its point reflection, so mask(-f) = mask(f) and
  the inverse FFT of the masked spectrum stays real."""
  sh, sw = 1 - mask.shape[1] % 2, 1 - mask.shape[2] % 2
  sub = mask[:, sh:, sw:]
  mh, mw = sub.shape[1] // 2, sub.shape[2] // 2
  sub = sub.at[:, sub.shape[1] - mh:, :].set(1.0)
  sub = sub.at[:, mh, :mw].set(1.0)
  sub = sub * sub[:, ::-1, ::-1]
  return mask.at[:, sh:, sw:].set(sub)


def spa_amplitude_mask(key: Array, x: Array, keep_prob: float = 0.8, ratio: float = 0.2) -> Array:
  """Low-frequency amplitude masking: every element (sample, channel, frequency) of the central
  ``ratio``-sized block of the centred amplitude spectrum is kept with ``keep_prob`` (SPA: 1 - 0.2),
  higher frequencies are untouched, the mask is made conjugate-symmetric, and the phase is kept.
  Multiplying the amplitude by a 0/1 mask with the phase kept is multiplying the spectrum by it."""
  b, h, w, c = x.shape
  (r0, rl), (c0, cl) = low_frequency_block(h, ratio), low_frequency_block(w, ratio)
  rows = (jnp.arange(h) >= r0) & (jnp.arange(h) < r0 + rl)
  cols = (jnp.arange(w) >= c0) & (jnp.arange(w) < c0 + cl)
  low = (rows[:, None] & cols[None, :])[None, :, :, None]
  keep = jax.random.bernoulli(key, keep_prob, x.shape)
  mask = _symmetric(jnp.where(low, keep, True).astype(jnp.float32))
  spec = jnp.fft.fft2(x, axes=(1, 2))
  spec = spec * jnp.fft.ifftshift(mask, axes=(1, 2))
  return jnp.real(jnp.fft.ifft2(spec, axes=(1, 2))).astype(x.dtype)


def spa_patch_noise(key: Array, x: Array, strengths: Array, patch: int = 16,
                    bounds: tuple[float, float] = (-1.0, 1.0)) -> Array:
  """Per-patch Gaussian noise mixing: patch k (row-major) becomes ``(1 - a_k^2) x + a_k^2 v`` with
  ``v ~ N(0, 1)``, then everything is clipped to ``bounds`` (SPA's [-1, 1], the image range under its
  0.5/0.5 normalisation). ``strengths`` are SPA's learnable ``alpha`` (``[(H/p) * (W/p)]``, initialised
  to sqrt(0.4)); the result is differentiable in them. As in SPA, ONE noise draw (``[H, W, C]``) is
  shared by the whole batch."""
  b, h, w, c = x.shape
  if h % patch or w % patch:
    raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
  a2 = jnp.square(strengths).reshape(h // patch, w // patch)
  a2 = jnp.repeat(jnp.repeat(a2, patch, axis=0), patch, axis=1)[None, :, :, None]
  v = jax.random.normal(key, (h, w, c), x.dtype)
  return jnp.clip((1.0 - a2) * x + a2 * v, bounds[0], bounds[1])
