"""`pcsr_jax.diffusion`: guided-diffusion's tables and respacing against numpy transcriptions of the official
formulas, the process's functions, the VLB helpers, resize_right's resize against an independent PyTorch
transcription (benchmarks/torch_methods/dda.py), and DDA's guided sampler against that reference with the same
noise and the same small eps model in both frameworks."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pcsr_jax import diffusion
from pcsr_jax.errors import UserError


# ---------------------------------------------------------------- schedules and respacing

def test_linear_schedule_and_the_100_respacing_as_the_official_formulas():
  s = diffusion.make_schedule(1000, "linear", "100")
  base = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
  ac = np.cumprod(1 - base)
  assert s.num_timesteps == 100
  assert list(s.timestep_map[:7]) == [0, 10, 20, 30, 40, 50, 61] and s.timestep_map[-1] == 999
  assert s.timestep_map[50] == 505 and s.timestep_map[49] == 494  # DDA's N=50: t=505; its first step: t=494
  # The respaced process has the original alpha_bar at every kept timestep (the betas telescope).
  np.testing.assert_allclose(s.alphas_cumprod, ac[s.timestep_map], rtol=1e-12)
  assert abs(s.alphas_cumprod[50] - 0.0743) < 5e-4
  # The derived tables, from the respaced betas as GaussianDiffusion.__init__ writes them.
  b = s.betas
  a = np.cumprod(1 - b)
  a_prev = np.append(1.0, a[:-1])
  post = b * (1 - a_prev) / (1 - a)
  np.testing.assert_allclose(s.posterior_variance, post, rtol=1e-12)
  np.testing.assert_allclose(s.posterior_log_variance_clipped, np.log(np.append(post[1], post[1:])), rtol=1e-12)
  np.testing.assert_allclose(s.posterior_mean_coef1, b * np.sqrt(a_prev) / (1 - a), rtol=1e-12)
  np.testing.assert_allclose(s.posterior_mean_coef2, (1 - a_prev) * np.sqrt(1 - b) / (1 - a), rtol=1e-12)
  np.testing.assert_allclose(s.sqrt_recipm1_alphas_cumprod, np.sqrt(1 / a - 1), rtol=1e-12)
  full = diffusion.make_schedule(1000, "linear", "")
  np.testing.assert_array_equal(full.betas, base)
  np.testing.assert_array_equal(full.timestep_map, np.arange(1000))


@pytest.mark.torch
@pytest.mark.parametrize("spec", ["100", "ddim50", "10,15,20", "250", "7", "1000"])
def test_space_timesteps_matches_the_reference(spec):
  from benchmarks.torch_methods.dda import SpacedDiffusion, space_timesteps

  assert diffusion.space_timesteps(1000, spec) == space_timesteps(1000, spec)
  s, ref = diffusion.make_schedule(1000, "linear", spec), SpacedDiffusion(1000, spec)
  np.testing.assert_allclose(s.betas, ref.betas, rtol=1e-12)
  np.testing.assert_allclose(s.posterior_log_variance_clipped, ref.posterior_log_variance_clipped, rtol=1e-12)


@pytest.mark.parametrize("spec, match", [("abc", "respacing: expected"), ("ddimx", "respacing: expected"),
                                         ("0", "respacing: expected"), ("ddim999", "no integer stride"),
                                         ("2000", "cannot divide a section of 1000 steps into 2000")])
def test_bad_respacing_is_one_line(spec, match):
  with pytest.raises(UserError, match=match) as e:
    diffusion.make_schedule(1000, "linear", spec)
  assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the process

def _tables_f32(s, name, t):
  return np.asarray(getattr(s, name), np.float32)[t][:, None, None, None]


def test_q_sample_and_p_mean_variance_follow_the_formulas():
  s = diffusion.make_schedule(1000, "linear", "100")
  rng = np.random.default_rng(0)
  x0 = rng.uniform(-1, 1, (3, 4, 4, 2)).astype(np.float32)
  noise = rng.standard_normal(x0.shape).astype(np.float32)
  t = np.array([0, 50, 99])
  xt = np.asarray(diffusion.q_sample(s, x0, t, noise))
  want = _tables_f32(s, "sqrt_alphas_cumprod", t) * x0 + _tables_f32(s, "sqrt_one_minus_alphas_cumprod", t) * noise
  np.testing.assert_allclose(xt, want, rtol=1e-6, atol=1e-6)

  out = rng.standard_normal((3, 4, 4, 4)).astype(np.float32)  # eps (2 ch) then v (2 ch)
  out[..., 2:] = np.tanh(out[..., 2:])
  pmv = diffusion.p_mean_variance(s, xt, t, out)
  x0_hat = np.clip(_tables_f32(s, "sqrt_recip_alphas_cumprod", t) * xt
                   - _tables_f32(s, "sqrt_recipm1_alphas_cumprod", t) * out[..., :2], -1, 1)
  np.testing.assert_allclose(pmv.pred_xstart, x0_hat, rtol=1e-5, atol=1e-5)
  assert np.abs(x0_hat).max() == 1.0  # the clip acted somewhere (t = 99 is mostly noise)
  frac = (out[..., 2:] + 1) / 2
  logvar = frac * _tables_f32(s, "log_betas", t) + (1 - frac) * _tables_f32(s, "posterior_log_variance_clipped", t)
  np.testing.assert_allclose(pmv.log_variance, logvar, rtol=1e-5, atol=1e-6)
  mean = _tables_f32(s, "posterior_mean_coef1", t) * x0_hat + _tables_f32(s, "posterior_mean_coef2", t) * xt
  np.testing.assert_allclose(pmv.mean, mean, rtol=1e-5, atol=1e-6)
  # the ancestral step adds no noise at index 0
  sample, _ = diffusion.p_sample(s, xt, t, out, noise)
  np.testing.assert_allclose(np.asarray(sample)[0], np.asarray(pmv.mean)[0], atol=0)
  assert not np.allclose(np.asarray(sample)[1], np.asarray(pmv.mean)[1])


def test_vlb_helpers():
  m, lv = jnp.array([0.3, -1.0]), jnp.array([-2.0, 0.5])
  np.testing.assert_allclose(diffusion.normal_kl(m, lv, m, lv), 0.0, atol=1e-7)
  # KL(N(0, 1) || N(1, e^2)) = log(e) + (1 + 1) / (2 e^2) - 1/2
  kl = diffusion.normal_kl(0.0, 0.0, 1.0, 2.0)
  np.testing.assert_allclose(kl, 1.0 + 2 / (2 * np.e ** 2) - 0.5, rtol=1e-6)
  # the discretized likelihood is a distribution over the 256 levels
  levels = jnp.linspace(-1, 1, 256)
  for mean, log_scale in ((0.1, -2.0), (-0.7, -4.0), (0.95, 0.0)):
    ll = diffusion.discretized_gaussian_log_likelihood(levels, jnp.full(256, mean), jnp.full(256, log_scale))
    np.testing.assert_allclose(float(jnp.sum(jnp.exp(ll))), 1.0, atol=1e-5)


def test_training_losses_stop_the_mean_gradient_in_the_bound():
  s = diffusion.make_schedule(1000, "linear", "")
  rng = np.random.default_rng(1)
  x0 = np.round(rng.uniform(-1, 1, (2, 4, 4, 3)) * 127.5) / 127.5
  noise = rng.standard_normal(x0.shape).astype(np.float32)
  t = jnp.array([0, 500])
  base = jnp.asarray(rng.standard_normal((2, 4, 4, 6)) * 0.3, jnp.float32)

  def losses(delta):
    return diffusion.training_losses(s, lambda x, tt: base + delta, jnp.asarray(x0, jnp.float32), t, noise)

  terms = losses(0.0)
  np.testing.assert_allclose(terms["mse"], np.mean((noise - np.asarray(base)[..., :3]) ** 2, axis=(1, 2, 3)),
                             rtol=1e-5)
  np.testing.assert_allclose(terms["loss"], terms["mse"] + terms["vb"], rtol=1e-6)
  g_vb = jax.grad(lambda d: jnp.sum(losses(d)["vb"]))(jnp.zeros_like(base))
  assert np.abs(np.asarray(g_vb)[..., :3]).max() == 0.0  # the bound trains the variance only
  assert np.abs(np.asarray(g_vb)[..., 3:]).max() > 0.0


# ---------------------------------------------------------------- resize_right

@pytest.mark.torch
@pytest.mark.parametrize("in_size, out_size, scale", [(32, 8, 0.25), (8, 32, 4.0), (20, 10, 0.5), (30, 7, 0.25),
                                                      (7, 28, 4.0), (64, 2, 1 / 32)])
def test_resize_matches_the_reference(in_size, out_size, scale):
  import torch

  from benchmarks.torch_methods.dda import resize

  x = np.random.default_rng(2).standard_normal((2, in_size, in_size + 3, 3)).astype(np.float32)
  mh = diffusion.resize_matrix(in_size, out_size, scale)
  mw = diffusion.resize_matrix(in_size + 3, int((in_size + 3) * out_size / in_size), scale)
  got = np.asarray(diffusion.apply_axes(jnp.asarray(x), jnp.asarray(mh, jnp.float32), jnp.asarray(mw, jnp.float32)))
  ref = resize(torch.from_numpy(x).permute(0, 3, 1, 2), scale, (mh.shape[0], mw.shape[0])).permute(0, 2, 3, 1)
  np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_phi_is_a_low_pass_that_darkens_the_border_as_the_zero_padding_does():
  x = jnp.ones((1, 64, 64, 1))
  y = np.asarray(diffusion.phi(x, 4))[0, :, :, 0]
  # A constant passes where no weight reaches the padding (the 16 px small image's pixels 2..13, and the outputs
  # whose cubic reads only those), ...
  np.testing.assert_allclose(y[16:48, 16:48], 1.0, atol=1e-6)
  # ... the padded zeros pull the border down (and the cubic's negative lobe overshoots just inside it).
  assert y[0, 32] < 0.7 and y[32, 0] < 0.7 and y[4, 32] > 1.01
  checker = jnp.asarray(np.indices((64, 64)).sum(0) % 2, jnp.float32)[None, :, :, None]
  assert float(jnp.abs(diffusion.phi(checker, 4) - 0.5)[0, 16:48, 16:48].max()) < 0.01  # the finest detail is gone


# ---------------------------------------------------------------- the guided sampler

C, HID = 3, 8


def standin_weights(seed: int = 0) -> dict:
  """A small eps model's weights: conv3x3 (C -> HID) + a timestep term, tanh, conv3x3 (HID -> 2C)."""
  rng = np.random.default_rng(seed)
  return dict(w1=rng.standard_normal((3, 3, C, HID)).astype(np.float32) * 0.3,
              b1=rng.standard_normal(HID).astype(np.float32) * 0.1,
              wt=rng.standard_normal(HID).astype(np.float32),
              w2=rng.standard_normal((3, 3, HID, 2 * C)).astype(np.float32) * 0.3)


def jax_standin(w: dict):
  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=jax.lax.Precision.HIGHEST)

  def model_fn(x, t):
    temb = jnp.sin(t.astype(jnp.float32)[:, None] / 100.0 * w["wt"])
    h = jnp.tanh(conv(x, w["w1"]) + w["b1"] + temb[:, None, None, :])
    return conv(h, w["w2"])

  return model_fn


def torch_standin(w: dict):
  import torch
  import torch.nn.functional as F

  k1 = torch.from_numpy(w["w1"]).permute(3, 2, 0, 1)
  k2 = torch.from_numpy(w["w2"]).permute(3, 2, 0, 1)
  b1, wt = torch.from_numpy(w["b1"]), torch.from_numpy(w["wt"])

  def model(x, t):
    temb = torch.sin(t.float()[:, None] / 100.0 * wt)
    h = torch.tanh(F.conv2d(x, k1, padding=1) + b1[None, :, None, None] + temb[:, :, None, None])
    return F.conv2d(h, k2, padding=1)

  return model


def _images(b: int = 2, size: int = 16, seed: int = 3) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.clip(rng.uniform(-1, 1, (b, size, size, C)), -1, 1).astype(np.float32)


def _to_torch(a):
  import torch

  return torch.from_numpy(np.array(a)).permute(0, 3, 1, 2)


@pytest.mark.torch
@pytest.mark.parametrize("N, guidance", [(3, "batch"), (10, "batch"), (10, "image")])
def test_guided_sampling_agrees_with_the_reference_with_the_same_noise(N, guidance):
  """Both frameworks in float32 from the same images, draws and eps model, free-running. Bound: 1e-4 absolute on
  the result (values of order 1; 7e-7 seen). Bit-level agreement is not expected: the two resize and sum in
  different orders, so each step differs by float32 rounding (~1e-6, the next test), which the later steps carry.
  Free-running, this random stand-in amplifies such differences by about 1.3x per step (its x0 predictions sit
  mostly on the clip, and it does not denoise), so 50 free-running steps end O(1) apart: the next test holds
  every one of the 50 steps instead."""
  from benchmarks.torch_methods import dda as ref

  s = diffusion.make_schedule(1000, "linear", "100")
  w = standin_weights()
  y = _images()
  key = jax.random.key(7)
  got = jax.jit(lambda yy, k: diffusion.guided_sample(s, jax_standin(w), yy, k, N=N, D=4, scale=6.0,
                                                      guidance=guidance))(y, key)
  noises = diffusion.sampler_noise(key, y.shape, N)
  want = ref.guided_sample(ref.SpacedDiffusion(1000, "100"), torch_standin(w), _to_torch(y),
                           [_to_torch(n) for n in noises], N, 4, 6.0, guidance)
  want = want.permute(0, 2, 3, 1).numpy()
  assert np.abs(want - y).max() > 0.1  # it did something
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.torch
def test_every_step_of_the_official_50_agrees_with_the_reference():
  """DDA's 50 steps (indices 49 .. 0, t 494 .. 0) each taken by `diffusion.guided_step` from the reference's own
  point with the same draw: within 2e-5 absolute of the reference's step at every index (4e-6 seen; float32
  rounding through the model's backward and the guidance, times scale 6)."""
  from benchmarks.torch_methods import dda as ref

  s, rd = diffusion.make_schedule(1000, "linear", "100"), ref.SpacedDiffusion(1000, "100")
  w = standin_weights()
  y = _images()
  N, D, scale = 50, 4, 6.0
  noises = np.asarray(diffusion.sampler_noise(jax.random.key(7), y.shape, N))
  x = np.asarray(diffusion.q_sample(s, y, jnp.full((2,), N), noises[0]))
  phi_y = diffusion.phi(jnp.asarray(y), D)
  step = jax.jit(lambda xx, i, n: diffusion.guided_step(s, jax_standin(w), xx, i, phi_y, n, D=D, scale=scale)[0])
  for j, i in enumerate(range(N)[::-1]):
    # the reference's step, as its loop takes it (one step of `ref.guided_sample`)
    want = ref.guided_sample_step(rd, torch_standin(w), _to_torch(x), i, ref.phi(_to_torch(y), D),
                                  _to_torch(noises[1 + j]), D, scale, "batch")
    want = want.permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(np.asarray(step(x, i, noises[1 + j])), want, atol=2e-5, rtol=0, err_msg=f"index {i}")
    x = want


def test_batch_guidance_couples_the_images_and_image_guidance_does_not():
  """One step from the same point with the same noise: the 'batch' gradient of image b is the 'image' one scaled
  by ||diff_b|| / ||diff|| (the norm over the batch couples them); changing image 1 moves image 0's step under
  'batch' only."""
  s = diffusion.make_schedule(1000, "linear", "100")
  model_fn = jax_standin(standin_weights())
  y = jnp.asarray(_images())
  x = diffusion.q_sample(s, y, jnp.full((2,), 20), jax.random.normal(jax.random.key(0), y.shape))
  noise = jax.random.normal(jax.random.key(1), y.shape)
  scale, D = 6.0, 4

  def step(yy, guidance):
    out, pmv = diffusion.guided_step(s, model_fn, x, 19, diffusion.phi(yy, D), noise, D=D, scale=scale,
                                     guidance=guidance)
    sample = pmv.mean + jnp.exp(0.5 * pmv.log_variance) * noise
    grad = (sample - out) / scale
    diff = diffusion.phi(yy, D) - diffusion.phi(pmv.pred_xstart, D)
    return out, grad, diff

  _, g_batch, diff = step(y, "batch")
  _, g_image, _ = step(y, "image")
  per = np.sqrt(np.sum(np.asarray(diff) ** 2, axis=(1, 2, 3)))
  total = np.sqrt(np.sum(per ** 2))
  for b in range(2):
    np.testing.assert_allclose(np.asarray(g_batch[b]) * total, np.asarray(g_image[b]) * per[b], rtol=1e-3,
                               atol=1e-5)
  assert not np.allclose(g_batch, g_image, rtol=1e-2)
  y2 = y.at[1].set(-y[1])
  for guidance, coupled in (("batch", True), ("image", False)):
    a, _, _ = step(y, guidance)
    b, _, _ = step(y2, guidance)
    assert (np.abs(np.asarray(a[0]) - np.asarray(b[0])).max() > 1e-4) == coupled, guidance


def test_sampler_is_deterministic_for_a_key_and_padding_rows_stay_out_of_the_norm():
  s = diffusion.make_schedule(1000, "linear", "100")
  model_fn = jax_standin(standin_weights())
  run = jax.jit(lambda y, k, rows: diffusion.guided_sample(s, model_fn, y, k, N=4, D=4, scale=6.0, rows=rows))
  y = _images()
  rows = jnp.array([True, False])
  a = np.asarray(run(y, jax.random.key(0), rows))
  np.testing.assert_array_equal(a, np.asarray(run(y, jax.random.key(0), rows)))
  assert np.abs(a - np.asarray(run(y, jax.random.key(1), rows))).max() > 1e-3
  other = y.copy()
  other[1] = -other[1]  # a different padding row: image 0 is unchanged
  np.testing.assert_allclose(np.asarray(run(other, jax.random.key(0), rows))[0], a[0], atol=1e-6)
  both = np.asarray(run(other, jax.random.key(0), jnp.array([True, True])))
  assert np.abs(both[0] - a[0]).max() > 1e-4  # with both rows in the norm it couples


def test_sampler_refuses_n_past_the_schedule():
  s = diffusion.make_schedule(1000, "linear", "100")
  with pytest.raises(ValueError, match="N: expected 1 to 99"):
    diffusion.guided_sample(s, jax_standin(standin_weights()), _images(), jax.random.key(0), N=100, D=4, scale=1.0)
