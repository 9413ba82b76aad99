"""Gaussian diffusion (guided-diffusion's maths) and DDA's guided sampler, as pure JAX functions.

Written from ``openai/guided-diffusion`` (``gaussian_diffusion.py``, ``respace.py``, ``losses.py``) and DDA's
fork of it (``shiyegao/DDA``: ``image_adapt/guided_diffusion/gaussian_diffusion.py``, ``image_adapt/
resize_right.py``, ``image_adapt/interp_methods.py``). Images are NHWC here (channels last), not NCHW.

* `Schedule`: the beta schedule and every table derived from it, computed in float64 with numpy as the official
  ``GaussianDiffusion.__init__`` does; a respaced schedule (`make_schedule` with ``respacing``) also holds the
  ``timestep_map`` from its indices to the original timesteps (``SpacedDiffusion``). Functions index the tables
  with a batch of indices and compute in float32 (``_extract_into_tensor`` casts the float64 table entries).
* `q_sample`, `q_posterior_mean_variance`, `p_mean_variance` (eps prediction, learned-range variance, x0 clipped
  to [-1, 1]), `p_sample` (the ancestral step): these take the model's output, not the model, so they are plain
  functions of arrays; `apply_model` calls a ``model_fn(x, t)`` at the original timestep.
* The VLB helpers (`normal_kl`, `discretized_gaussian_log_likelihood`, `vb_terms_bpd`) and `training_losses`:
  guided-diffusion's ``LossType.MSE`` with a learned variance (MSE on eps + the VLB term with the mean's
  gradient stopped), for a training script.
* `resize_matrix`: resize_right's cubic, antialiased resize as one weight matrix per axis (built once in numpy,
  applied with an einsum: `apply_axes`); `phi` DDA's low-pass filter ``up_D(down_D(z))`` (`phi_matrix`).
* `guided_sample`: DDA's sampler (``p_sample_loop_progressive`` with ``N``, ``D``, ``scale``) as one jit-able
  program: a ``lax.fori_loop`` over the steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from pcsr_jax.errors import UserError

Array = jax.Array
ModelFn = Callable[[Array, Array], Array]  # (x NHWC float32, original timesteps int32 [B]) -> NHWC output

GUIDANCE = ("batch", "image")


# ---------------------------------------------------------------- schedules

def named_betas(name: str, steps: int) -> np.ndarray:
  """guided-diffusion's ``get_named_beta_schedule``: 'linear' (Ho et al.'s 1e-4 .. 0.02, scaled by 1000/steps)
  or 'cosine' (Nichol & Dhariwal's, betas capped at 0.999), float64."""
  if name == "linear":
    scale = 1000 / steps
    return np.linspace(scale * 0.0001, scale * 0.02, steps, dtype=np.float64)
  if name == "cosine":
    f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return np.array([min(1 - f((i + 1) / steps) / f(i / steps), 0.999) for i in range(steps)], np.float64)
  raise UserError(f"noise_schedule: expected linear or cosine, got {name!r}")


def check_respacing(section_counts: Union[str, Sequence[int]]) -> Union[int, list[int], None]:
  """The parsed ``section_counts`` of `space_timesteps`, checked for its form only (one-line `UserError`):
  the N of "ddimN" (an int), the step counts per section (a list), or None for "" (every step)."""
  what = f"respacing: expected ddimN, comma-separated positive step counts or '' (every step), got {section_counts!r}"
  if isinstance(section_counts, str):
    if not section_counts:
      return None
    try:
      if section_counts.startswith("ddim"):
        desired = int(section_counts[len("ddim"):])
        if desired < 1:
          raise ValueError
        return desired
      counts = [int(c) for c in section_counts.split(",")]
    except ValueError:
      raise UserError(what) from None
  else:
    counts = list(section_counts)
  if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
    raise UserError(what)
  return counts


def space_timesteps(num_timesteps: int, section_counts: Union[str, Sequence[int]]) -> list[int]:
  """The original timesteps a respaced process keeps, sorted (guided-diffusion's ``space_timesteps``).

  ``section_counts``: "ddimN" (the largest integer stride giving exactly N steps, DDIM's), or step counts per
  equal section of the process, as a list or a comma-separated string ("100": 100 steps spread over all 1000;
  "10,15,20": three sections). Within a section the steps are ``round(k * stride)`` with the fractional
  stride accumulated as a float, as the official loop does (so "100" keeps 0, 10, 20, 30, 40, 50, 61, ...,
  505, ..., 999). An empty string keeps every step (``create_gaussian_diffusion``'s default).
  """
  parsed = check_respacing(section_counts)
  if parsed is None:
    return list(range(num_timesteps))
  if isinstance(parsed, int):
    for stride in range(1, num_timesteps):
      if len(range(0, num_timesteps, stride)) == parsed:
        return list(range(0, num_timesteps, stride))
    raise UserError(f"respacing {section_counts!r}: no integer stride gives exactly {parsed} of {num_timesteps} "
                    f"steps")
  size_per, extra = divmod(num_timesteps, len(parsed))
  start, steps = 0, []
  for i, count in enumerate(parsed):
    size = size_per + (1 if i < extra else 0)
    if size < count:
      raise UserError(f"respacing {section_counts!r}: cannot divide a section of {size} steps into {count}")
    stride = 1 if count <= 1 else (size - 1) / (count - 1)
    cur = 0.0
    for _ in range(count):
      steps.append(start + round(cur))
      cur += stride
    start += size
  return sorted(set(steps))


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A diffusion process's tables (float64 numpy, as ``GaussianDiffusion.__init__``), indexed by step index.

  Built from ``betas`` and ``timestep_map``; the other fields are derived. ``timestep_map[i]`` is the original
  timestep of index ``i``: the identity for an unrespaced process, the kept timesteps for a respaced one (the
  model always sees the original timestep; ``rescale_timesteps`` False). Compared by identity (``eq=False``), so
  a schedule can be closed over by jitted functions.
  """

  betas: np.ndarray
  timestep_map: np.ndarray
  alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  alphas_cumprod_prev: np.ndarray = dataclasses.field(init=False)
  sqrt_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_one_minus_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  log_one_minus_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_recip_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  sqrt_recipm1_alphas_cumprod: np.ndarray = dataclasses.field(init=False)
  posterior_variance: np.ndarray = dataclasses.field(init=False)
  posterior_log_variance_clipped: np.ndarray = dataclasses.field(init=False)
  posterior_mean_coef1: np.ndarray = dataclasses.field(init=False)
  posterior_mean_coef2: np.ndarray = dataclasses.field(init=False)
  log_betas: np.ndarray = dataclasses.field(init=False)

  def __post_init__(self):
    b = np.asarray(self.betas, np.float64)
    if b.ndim != 1 or not ((b > 0).all() and (b <= 1).all()):
      raise ValueError("betas must be 1-D and in (0, 1]")
    ac = np.cumprod(1.0 - b)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = b * (1.0 - ac_prev) / (1.0 - ac)
    tables = dict(
        betas=b, timestep_map=np.asarray(self.timestep_map, np.int32), alphas_cumprod=ac,
        alphas_cumprod_prev=ac_prev, sqrt_alphas_cumprod=np.sqrt(ac), sqrt_one_minus_alphas_cumprod=np.sqrt(1.0 - ac),
        log_one_minus_alphas_cumprod=np.log(1.0 - ac), sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac),
        sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1), posterior_variance=post_var,
        # The posterior variance is 0 at the first step: its log is clipped to the second step's (as the official).
        posterior_log_variance_clipped=np.log(np.append(post_var[1], post_var[1:])),
        posterior_mean_coef1=b * np.sqrt(ac_prev) / (1.0 - ac),
        posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(1.0 - b) / (1.0 - ac), log_betas=np.log(b))
    for k, v in tables.items():
      object.__setattr__(self, k, v)  # a frozen dataclass sets its derived fields once, here

  @property
  def num_timesteps(self) -> int:
    return int(self.betas.shape[0])


def make_schedule(steps: int = 1000, noise_schedule: str = "linear", respacing: Union[str, Sequence[int]] = ""
                  ) -> Schedule:
  """The (respaced) process of ``create_gaussian_diffusion``: ``steps`` betas of ``noise_schedule``, then, for the
  kept timesteps (`space_timesteps`), betas ``1 - alpha_bar[t] / alpha_bar[previous kept t]`` (``SpacedDiffusion``)."""
  betas = named_betas(noise_schedule, steps)
  keep = space_timesteps(steps, respacing)
  if len(keep) == steps:
    return Schedule(betas, np.arange(steps))
  ac = np.cumprod(1.0 - betas)
  last, new = 1.0, []
  for t in keep:
    new.append(1 - ac[t] / last)
    last = ac[t]
  return Schedule(np.array(new), np.array(keep))


def _take(table: np.ndarray, t: Array, ndim: int) -> Array:
  """``table[t]`` as float32, shaped ``[B, 1, ..., 1]`` to broadcast over a batch of ``ndim``-D arrays."""
  v = jnp.asarray(table, jnp.float32)[t]
  return v.reshape(v.shape + (1,) * (ndim - 1))


# ---------------------------------------------------------------- the process

def q_sample(s: Schedule, x_start: Array, t: Array, noise: Array) -> Array:
  """A draw of ``q(x_t | x_0)``: ``sqrt(alpha_bar) x_0 + sqrt(1 - alpha_bar) noise`` at step indices ``t``."""
  n = x_start.ndim
  return _take(s.sqrt_alphas_cumprod, t, n) * x_start + _take(s.sqrt_one_minus_alphas_cumprod, t, n) * noise


def q_posterior_mean_variance(s: Schedule, x_start: Array, x_t: Array, t: Array) -> tuple[Array, Array, Array]:
  """``q(x_{t-1} | x_t, x_0)``: ``(mean, variance, clipped log variance)``."""
  n = x_t.ndim
  mean = _take(s.posterior_mean_coef1, t, n) * x_start + _take(s.posterior_mean_coef2, t, n) * x_t
  return mean, _take(s.posterior_variance, t, n), _take(s.posterior_log_variance_clipped, t, n)


def predict_xstart_from_eps(s: Schedule, x_t: Array, t: Array, eps: Array) -> Array:
  n = x_t.ndim
  return _take(s.sqrt_recip_alphas_cumprod, t, n) * x_t - _take(s.sqrt_recipm1_alphas_cumprod, t, n) * eps


class MeanVariance(NamedTuple):
  """What `p_mean_variance` returns (the official dict's keys)."""

  mean: Array
  variance: Array
  log_variance: Array
  pred_xstart: Array


def apply_model(s: Schedule, model_fn: ModelFn, x: Array, t: Array) -> Array:
  """The model at step indices ``t``, given the ORIGINAL timesteps (``_WrappedModel``: ``timestep_map[t]``)."""
  return model_fn(x, jnp.asarray(s.timestep_map)[t])


def p_mean_variance(s: Schedule, x: Array, t: Array, model_output: Array, clip_denoised: bool = True,
                    learn_sigma: bool = True) -> MeanVariance:
  """``p(x_{t-1} | x_t)`` from the model's output at ``x``: eps prediction (``ModelMeanType.EPSILON``).

  ``learn_sigma``: the output holds 2C channels, eps then ``v`` in [-1, 1], and the log variance interpolates
  ``frac * log(beta_t) + (1 - frac) * log(beta_tilde_t)`` with ``frac = (v + 1) / 2`` (``LEARNED_RANGE``);
  otherwise C channels and the fixed small variance (``FIXED_SMALL``, beta_tilde). x0 is clipped to [-1, 1]
  when ``clip_denoised``, and the mean is the posterior's at that x0.
  """
  c, n = x.shape[-1], x.ndim
  if learn_sigma:
    if model_output.shape[-1] != 2 * c:
      raise ValueError(f"learn_sigma: expected {2 * c} output channels, got {model_output.shape[-1]}")
    eps, v = model_output[..., :c], model_output[..., c:]
    min_log = _take(s.posterior_log_variance_clipped, t, n)
    max_log = _take(s.log_betas, t, n)
    frac = (v + 1) / 2
    log_variance = frac * max_log + (1 - frac) * min_log
    variance = jnp.exp(log_variance)
  else:
    eps = model_output
    variance = jnp.broadcast_to(_take(s.posterior_variance, t, n), x.shape)
    log_variance = jnp.broadcast_to(_take(s.posterior_log_variance_clipped, t, n), x.shape)
  pred_xstart = predict_xstart_from_eps(s, x, t, eps)
  if clip_denoised:
    pred_xstart = jnp.clip(pred_xstart, -1, 1)
  mean, _, _ = q_posterior_mean_variance(s, pred_xstart, x, t)
  return MeanVariance(mean, variance, log_variance, pred_xstart)


def p_sample(s: Schedule, x: Array, t: Array, model_output: Array, noise: Array, clip_denoised: bool = True,
             learn_sigma: bool = True) -> tuple[Array, MeanVariance]:
  """The ancestral step: ``mean + [t != 0] exp(log_variance / 2) noise`` (no noise at index 0); ``(sample, pmv)``."""
  out = p_mean_variance(s, x, t, model_output, clip_denoised, learn_sigma)
  nonzero = (t != 0).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
  return out.mean + nonzero * jnp.exp(0.5 * out.log_variance) * noise, out


# ---------------------------------------------------------------- the variational bound (training)

def normal_kl(mean1: Array, logvar1: Array, mean2: Array, logvar2: Array) -> Array:
  """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise (nats)."""
  return 0.5 * (-1.0 + logvar2 - logvar1 + jnp.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * jnp.exp(-logvar2))


def approx_standard_normal_cdf(x: Array) -> Array:
  """The tanh approximation of the standard normal CDF that guided-diffusion uses."""
  return 0.5 * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x: Array, means: Array, log_scales: Array) -> Array:
  """Log-likelihood (nats) of images ``x`` (uint8 values scaled to [-1, 1]) under a Gaussian discretized to the
  256 bins; the end bins take the tails (``x < -0.999``, ``x > 0.999``), probabilities floored at 1e-12."""
  centered = x - means
  inv_stdv = jnp.exp(-log_scales)
  cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
  cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
  log_cdf_plus = jnp.log(jnp.maximum(cdf_plus, 1e-12))
  log_one_minus_cdf_min = jnp.log(jnp.maximum(1.0 - cdf_min, 1e-12))
  log_delta = jnp.log(jnp.maximum(cdf_plus - cdf_min, 1e-12))
  return jnp.where(x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def _mean_flat(x: Array) -> Array:
  return jnp.mean(x, axis=tuple(range(1, x.ndim)))


def vb_terms_bpd(s: Schedule, x_start: Array, x_t: Array, t: Array, model_output: Array,
                 clip_denoised: bool = False) -> Array:
  """One VLB term per image in bits per dim: the decoder NLL at index 0, else KL(q(x_{t-1}|x_t,x_0) || p)."""
  true_mean, _, true_logvar = q_posterior_mean_variance(s, x_start, x_t, t)
  out = p_mean_variance(s, x_t, t, model_output, clip_denoised, learn_sigma=True)
  kl = _mean_flat(normal_kl(true_mean, true_logvar, out.mean, out.log_variance)) / math.log(2.0)
  nll = -discretized_gaussian_log_likelihood(x_start, out.mean, 0.5 * out.log_variance)
  return jnp.where(t == 0, _mean_flat(nll) / math.log(2.0), kl)


def training_losses(s: Schedule, model_fn: ModelFn, x_start: Array, t: Array, noise: Array) -> dict[str, Array]:
  """guided-diffusion's ``training_losses`` with ``LossType.MSE`` and a learned-range variance, per image:
  ``mse`` (of the eps prediction), ``vb`` (`vb_terms_bpd` with the eps output's gradient stopped, so the
  bound trains only the variance) and ``loss = mse + vb``. ``t`` are step indices (the model sees
  ``timestep_map[t]``). For a respaced or a non-1000-step process the official RESCALED_MSE would scale ``vb``
  by ``num_timesteps / 1000``; MSE (the default flags) does not."""
  x_t = q_sample(s, x_start, t, noise)
  out = apply_model(s, model_fn, x_t, t)
  c = x_start.shape[-1]
  eps = out[..., :c]
  frozen = jnp.concatenate([jax.lax.stop_gradient(eps), out[..., c:]], axis=-1)
  vb = vb_terms_bpd(s, x_start, x_t, t, frozen, clip_denoised=False)
  mse = _mean_flat((noise - eps) ** 2)
  return {"loss": mse + vb, "mse": mse, "vb": vb}


# ---------------------------------------------------------------- resize_right's cubic resize

_F32_EPS = float(np.finfo(np.float32).eps)


def cubic(x: np.ndarray) -> np.ndarray:
  """Keys' cubic kernel with a = -0.5 (resize_right's ``interp_methods.cubic``), support 4."""
  a = np.abs(x)
  return ((1.5 * a ** 3 - 2.5 * a ** 2 + 1.0) * (a <= 1.0)
          + (-0.5 * a ** 3 + 2.5 * a ** 2 - 4.0 * a + 2.0) * ((1.0 < a) & (a <= 2.0)))


def resize_matrix(in_size: int, out_size: int, scale: float) -> np.ndarray:
  """``[out_size, in_size]`` float64 weights of resize_right's ``resize`` along one axis (cubic, antialiased,
  ``by_convs`` False, ``pad_mode='constant'``), at scale factor ``scale`` (as the caller gives it: DDA passes
  ``1/D`` and ``D``, not ``out/in``).

  Output pixel ``o`` sits at ``o / scale + (in - 1) / 2 - (out - 1) / (2 scale)`` in input coordinates. When
  downscaling, the kernel is stretched to ``scale * cubic(scale * x)`` and its support to ``4 / scale``
  (antialiasing). Each output's weights over its ``ceil(support)`` nearest input positions are divided by their
  sum, positions outside the image included: those read the zero padding, so near the border the weights kept
  sum to less than one (the image darkens towards the edge, as the official does).
  """
  grid = np.arange(out_size) / scale + (in_size - 1) / 2 - (out_size - 1) / (2 * scale)
  kernel, support = cubic, 4.0
  if scale < 1.0:
    kernel, support = (lambda x: scale * cubic(scale * x)), 4.0 / scale
  left = np.ceil(grid - support / 2 - _F32_EPS).astype(np.int64)
  fov = left[:, None] + np.arange(math.ceil(support - _F32_EPS))
  w = kernel(grid[:, None] - fov)
  total = w.sum(1, keepdims=True)
  w = w / np.where(total == 0, 1.0, total)
  m = np.zeros((out_size, in_size))
  inside = (fov >= 0) & (fov < in_size)
  rows = np.broadcast_to(np.arange(out_size)[:, None], fov.shape)
  np.add.at(m, (rows[inside], fov[inside]), w[inside])
  return m


@functools.lru_cache(maxsize=None)
def phi_matrix(size: int, D: int) -> np.ndarray:
  """DDA's low-pass filter along one axis of ``size`` pixels: resize by ``1/D`` to ``int(size / D)`` pixels,
  then by ``D`` back to ``size`` (``[size, size]`` float64: the two `resize_matrix` weights multiplied; cached,
  so read-only)."""
  small = int(size / D)
  m = resize_matrix(small, size, float(D)) @ resize_matrix(size, small, 1.0 / D)
  m.setflags(write=False)
  return m


def apply_axes(x: Array, mh: Array, mw: Array) -> Array:
  """``x`` NHWC resized by the weight matrices ``mh`` (rows) and ``mw`` (columns); float32 at full precision
  (a TF32 matmul on a GPU would add ~1e-3 relative error to the guidance)."""
  return jnp.einsum("ih,nhwc,jw->nijc", mh, x, mw, precision=jax.lax.Precision.HIGHEST)


def phi(x: Array, D: int) -> Array:
  """``phi_D(x) = up_D(down_D(x))`` of NHWC images (DDA's ``resize(resize(x, 1/D), D)``)."""
  mh = jnp.asarray(phi_matrix(x.shape[1], D), jnp.float32)
  mw = jnp.asarray(phi_matrix(x.shape[2], D), jnp.float32)
  return apply_axes(x, mh, mw)


# ---------------------------------------------------------------- DDA's guided sampler

def _safe_norm(sq: Array) -> Array:
  """``sqrt(sq)`` with a zero gradient at 0 (torch's norm backward), not NaN."""
  pos = sq > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)


def guidance_norm(diff: Array, guidance: str) -> Array:
  """The guidance objective of ``diff = phi(y) - phi(x0_hat)``: 'batch' the official ``th.linalg.norm(diff)``,
  one L2 norm over the whole batch tensor; 'image' the sum of one norm per image (so each image's gradient is
  its own norm's)."""
  if guidance == "batch":
    return _safe_norm(jnp.sum(diff ** 2))
  if guidance == "image":
    return jnp.sum(_safe_norm(jnp.sum(diff ** 2, axis=tuple(range(1, diff.ndim)))))
  raise ValueError(f"guidance: expected one of {GUIDANCE}, got {guidance!r}")


def sampler_noise(key: Array, shape: tuple[int, ...], N: int) -> Array:
  """The normal noise `guided_sample` draws from ``key``: ``[N + 1, *shape]``, row 0 for ``q_sample``, row
  ``1 + j`` for the j-th step (index ``N - 1 - j``). Drawn row by row inside the loop; here all at once, for
  references that need the same noise."""
  keys = jax.random.split(key, N + 1)
  return jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(keys)


def guided_step(s: Schedule, model_fn: ModelFn, x: Array, i: Array, phi_y: Array, noise: Array, *, D: int,
                scale: float, guidance: str = "batch", learn_sigma: bool = True, rows: Optional[Array] = None
                ) -> tuple[Array, MeanVariance]:
  """One step of DDA's loop at step index ``i``: the model and `p_mean_variance` at ``x``, the ancestral
  `p_sample`, then ``sample - scale * d||phi(y) - phi(x0_hat(x))|| / dx`` (through the model and the clip).
  ``rows`` (bool ``[B]``, None: all): the images that enter the norm (padding rows stay out of it, and get no
  guidance). Returns ``(x_{i-1}, pmv at x)``."""
  t = jnp.full((x.shape[0],), i, jnp.int32)

  def objective(xt):
    out = p_mean_variance(s, xt, t, apply_model(s, model_fn, xt, t), True, learn_sigma)
    diff = phi_y - phi(out.pred_xstart, D)
    if rows is not None:
      diff = jnp.where(rows.reshape((-1,) + (1,) * (diff.ndim - 1)), diff, 0.0)
    return guidance_norm(diff, guidance), out

  (_, out), grad = jax.value_and_grad(objective, has_aux=True)(x)
  nonzero = jnp.asarray(i != 0, x.dtype)
  sample = out.mean + nonzero * jnp.exp(0.5 * out.log_variance) * noise
  return sample - scale * grad, out


def guided_sample(s: Schedule, model_fn: ModelFn, y: Array, key: Array, *, N: int, D: int, scale: float,
                  guidance: str = "batch", learn_sigma: bool = True, rows: Optional[Array] = None) -> Array:
  """DDA's projection of the NHWC images ``y`` (in [-1, 1]) towards the diffusion model's source domain.

  As ``p_sample_loop_progressive(noise=y, N, D, scale)``: ``x = q_sample(y, index N)``, then for indices
  ``N - 1, ..., 0`` a `guided_step` (the guidance at every step, the last step without noise). Official
  off-by-one, kept: ``y`` is noised to index ``N`` (with the "100" respacing, original t = 505, alpha_bar
  about 0.074) but the loop starts at index ``N - 1`` (t = 494), so the model never denoises index ``N``
  itself and the chain takes N steps from a point one step noisier than its first. ``N`` must be below the
  schedule's number of steps. ``guidance``: 'batch' is the official norm over the whole batch tensor, which
  couples the images that share a batch (each image's step is scaled by ``||diff_b|| / ||diff||``); 'image'
  uses one norm per image. ``rows``: as `guided_step`. The noise comes from ``key`` (`sampler_noise`: split
  per step). One program: a ``lax.fori_loop`` over the N steps."""
  if not 0 < N < s.num_timesteps:
    raise ValueError(f"N: expected 1 to {s.num_timesteps - 1} (below the respaced step count), got {N}")
  if guidance not in GUIDANCE:
    raise ValueError(f"guidance: expected one of {GUIDANCE}, got {guidance!r}")
  keys = jax.random.split(key, N + 1)
  normal = lambda k: jax.random.normal(k, y.shape, jnp.float32)
  y = y.astype(jnp.float32)
  x = q_sample(s, y, jnp.full((y.shape[0],), N, jnp.int32), normal(keys[0]))
  phi_y = phi(y, D)

  def body(j, x):
    x, _ = guided_step(s, model_fn, x, N - 1 - j, phi_y, normal(keys[j + 1]), D=D, scale=scale,
                       guidance=guidance, learn_sigma=learn_sigma, rows=rows)
    return x

  return jax.lax.fori_loop(0, N, body, x)
