"""DDA in PyTorch, written as its official code (``shiyegao/DDA``: ``image_adapt/guided_diffusion/
gaussian_diffusion.py`` ``p_sample_loop_progressive`` with ``N``, ``D``, ``scale``; ``respace.py``;
``image_adapt/resize_right.py`` + ``interp_methods.py``; ``image_adapt/scripts/image_sample.py``; the ensemble of
``model_adapt/evaluation.py``). Images are NCHW here, as the official.

* `resize`: resize_right's ``resize`` for NCHW tensors, cubic and antialiased, as the official computes it: per
  resized axis a projected grid, a field of view of input positions, zero padding (``pad_mode='constant'``) and
  normalised weights applied by gathering (not the weight matrices `pcsr_jax.diffusion` builds), so the two are
  independent transcriptions.
* `SpacedDiffusion`: the tables (numpy float64, cast to float32 per lookup as ``_extract_into_tensor``), ``q_sample``,
  ``p_mean_variance`` (eps, learned range, x0 clamped), with the model called at ``timestep_map[t]``.
* `guided_sample`: the official loop; its noise is given (``noises[0]`` for ``q_sample``, ``noises[1 + j]`` for
  step j), so a test can feed both frameworks the same draws (`pcsr_jax.diffusion.sampler_noise`).
* `Reference(model, batch_size, unet=..., ...)`: the method for the benchmarks: per batch the projection of
  every group of ``group`` images, the PIL JPEG round trip, and the ensemble of the classifier's two outputs.
  ``unet`` is a torch module ``unet(x_nchw, t) -> NCHW`` (``benchmarks/torch_methods/guided_unet.py``'s).
"""

from __future__ import annotations

import io
import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

_EPS = float(np.finfo(np.float32).eps)


def cubic(x: torch.Tensor) -> torch.Tensor:
  """``interp_methods.cubic`` (support 4)."""
  a = x.abs()
  return ((1.5 * a ** 3 - 2.5 * a ** 2 + 1.0) * (a <= 1.0).to(x.dtype)
          + (-0.5 * a ** 3 + 2.5 * a ** 2 - 4.0 * a + 2.0) * ((a > 1.0) & (a <= 2.0)).to(x.dtype))


def _resize_axis(x: torch.Tensor, dim: int, scale: float, out_size: int) -> torch.Tensor:
  in_size = x.shape[dim]
  grid = (torch.arange(out_size, device=x.device) / scale + (in_size - 1) / 2 - (out_size - 1) / (2 * scale))
  kernel, support = cubic, 4.0
  if scale < 1.0:  # antialiasing: the kernel stretched by 1 / scale
    kernel, support = (lambda d: scale * cubic(scale * d)), 4.0 / scale
  left = torch.ceil(grid - support / 2 - _EPS).long()
  fov = left[:, None] + torch.arange(math.ceil(support - _EPS), device=x.device)
  pad = (-int(fov[0, 0]), int(fov[-1, -1]) - in_size + 1)  # negative: a crop, as F.pad does
  fov = fov + pad[0]
  grid = grid + pad[0]
  w = kernel(grid[:, None] - fov)
  total = w.sum(1, keepdim=True)
  total[total == 0] = 1
  w = w / total
  moved = x.transpose(dim, -1)
  moved = F.pad(moved, pad, mode="constant")  # zeros outside the image
  gathered = moved[..., fov]  # [..., out, support]
  return (gathered * w.to(x.dtype)).sum(-1).transpose(dim, -1)


def resize(x: torch.Tensor, scale: float, out_hw: tuple[int, int]) -> torch.Tensor:
  """resize_right's ``resize(x, scale_factors=scale, out_shape=(N, C, *out_hw))`` of an NCHW tensor: the two
  spatial axes, H then W (both have the same scale, so its sort by scale keeps their order)."""
  x = _resize_axis(x, 2, scale, out_hw[0])
  return _resize_axis(x, 3, scale, out_hw[1])


def phi(x: torch.Tensor, D: int) -> torch.Tensor:
  """DDA's ``resize(resize(x, 1/D, shape_d), D, shape_u)``."""
  h, w = x.shape[2:]
  small = resize(x, 1.0 / D, (int(h / D), int(w / D)))
  return resize(small, float(D), (h, w))


def space_timesteps(num_timesteps: int, section_counts: str) -> list[int]:
  """guided-diffusion's ``space_timesteps`` (sorted)."""
  if section_counts.startswith("ddim"):
    desired = int(section_counts[4:])
    for i in range(1, num_timesteps):
      if len(range(0, num_timesteps, i)) == desired:
        return list(range(0, num_timesteps, i))
    raise ValueError(section_counts)
  counts = [int(c) for c in section_counts.split(",")]
  size_per, extra = num_timesteps // len(counts), num_timesteps % len(counts)
  start, steps = 0, []
  for i, count in enumerate(counts):
    size = size_per + (1 if i < extra else 0)
    stride = 1 if count <= 1 else (size - 1) / (count - 1)
    cur = 0.0
    for _ in range(count):
      steps.append(start + round(cur))
      cur += stride
    start += size
  return sorted(set(steps))


class SpacedDiffusion:
  """guided-diffusion's ``SpacedDiffusion`` over the linear schedule of ``steps``, eps prediction, learned-range
  variance, ``rescale_timesteps`` False."""

  def __init__(self, steps: int = 1000, respacing: str = "100"):
    scale = 1000 / steps
    base = np.linspace(scale * 0.0001, scale * 0.02, steps, dtype=np.float64)
    keep = space_timesteps(steps, respacing) if respacing else list(range(steps))
    ac_base = np.cumprod(1.0 - base, axis=0)
    kept, last, betas = set(keep), 1.0, []
    for i, a in enumerate(ac_base):
      if i in kept:
        betas.append(1 - a / last)
        last = a
    self.timestep_map = keep
    self.betas = betas = np.array(betas, dtype=np.float64)
    self.num_timesteps = len(betas)
    ac = np.cumprod(1.0 - betas, axis=0)
    ac_prev = np.append(1.0, ac[:-1])
    self.alphas_cumprod = ac
    self.sqrt_alphas_cumprod = np.sqrt(ac)
    self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - ac)
    self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / ac)
    self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / ac - 1)
    self.posterior_variance = betas * (1.0 - ac_prev) / (1.0 - ac)
    self.posterior_log_variance_clipped = np.log(np.append(self.posterior_variance[1], self.posterior_variance[1:]))
    self.posterior_mean_coef1 = betas * np.sqrt(ac_prev) / (1.0 - ac)
    self.posterior_mean_coef2 = (1.0 - ac_prev) * np.sqrt(1.0 - betas) / (1.0 - ac)

  @staticmethod
  def _extract(arr: np.ndarray, t: torch.Tensor, shape) -> torch.Tensor:
    res = torch.from_numpy(arr).to(device=t.device)[t].float()
    while res.ndim < len(shape):
      res = res[..., None]
    return res.expand(shape)

  def q_sample(self, x_start, t, noise):
    return (self._extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
            + self._extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise)

  def p_mean_variance(self, model: Callable, x: torch.Tensor, t: torch.Tensor) -> dict:
    b, c = x.shape[:2]
    new_t = torch.tensor(self.timestep_map, device=t.device, dtype=t.dtype)[t]  # _WrappedModel
    out = model(x, new_t)
    eps, v = torch.split(out, c, dim=1)
    min_log = self._extract(self.posterior_log_variance_clipped, t, x.shape)
    max_log = self._extract(np.log(self.betas), t, x.shape)
    frac = (v + 1) / 2
    log_variance = frac * max_log + (1 - frac) * min_log
    pred_xstart = (self._extract(self.sqrt_recip_alphas_cumprod, t, x.shape) * x
                   - self._extract(self.sqrt_recipm1_alphas_cumprod, t, x.shape) * eps).clamp(-1, 1)
    mean = (self._extract(self.posterior_mean_coef1, t, x.shape) * pred_xstart
            + self._extract(self.posterior_mean_coef2, t, x.shape) * x)
    return {"mean": mean, "log_variance": log_variance, "pred_xstart": pred_xstart}


def guided_sample_step(diff: SpacedDiffusion, model: Callable, img: torch.Tensor, i: int, phi_y: torch.Tensor,
                       noise: torch.Tensor, D: int, scale: float, guidance: str = "batch") -> torch.Tensor:
  """One pass of the official loop at index ``i``: ``p_sample`` (the draw given), then the guidance step."""
  b = img.shape[0]
  t = torch.full((b,), i, dtype=torch.long, device=img.device)
  img = img.detach().requires_grad_()
  out = diff.p_mean_variance(model, img, t)
  nonzero = (t != 0).float().view(-1, 1, 1, 1)
  sample = out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise
  difference = phi_y - phi(out["pred_xstart"], D)
  if guidance == "batch":
    norm = torch.linalg.norm(difference)
  else:
    norm = torch.linalg.norm(difference.flatten(1), dim=1).sum()
  grad = torch.autograd.grad(norm, img)[0]
  return (sample - grad * scale).detach()


def guided_sample(diff: SpacedDiffusion, model: Callable, y: torch.Tensor, noises: Sequence[torch.Tensor], N: int,
                  D: int, scale: float, guidance: str = "batch") -> torch.Tensor:
  """``p_sample_loop(model, shape, noise=y, N, D, scale)`` with the given normal draws; ``guidance='image'``
  replaces the batch norm with a sum of per-image norms."""
  img = diff.q_sample(y, torch.full((y.shape[0],), N, dtype=torch.long, device=y.device), noises[0])
  phi_y = phi(y, D)
  for j, i in enumerate(range(N)[::-1]):  # q_sample at index N, then indices N - 1 .. 0: the official off-by-one
    img = guided_sample_step(diff, model, img, i, phi_y, noises[1 + j], D, scale, guidance)
  return img


def jpeg_round_trip(x: torch.Tensor, quality: int) -> torch.Tensor:
  """``torchvision.utils.save_image(x, 'a.JPEG', normalize=True, range=(-1, 1))`` and the file read back, in
  [0, 1] (NCHW)."""
  from PIL import Image

  u8 = ((x.clamp(-1, 1) + 1) / 2).mul(255).add(0.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
  out = []
  for img in u8:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    out.append(np.asarray(Image.open(buf).convert("RGB")))
  return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float().div(255).to(x.device)


class Reference:
  """DDA for the benchmarks: ``step(x_nchw) -> log-probabilities`` of the ``sum`` ensemble (the official's
  ``--ensemble sum``); normalised input with ``mean``/``std``; the projection in groups of ``group``; the UNet at
  ``image_size`` (F.interpolate bicubic with antialias there and back when the sizes differ)."""

  def __init__(self, model: torch.nn.Module, batch_size: int, unet: Optional[torch.nn.Module] = None, D: int = 4,
               N: int = 50, scale: float = 6.0, respacing: str = "100", jpeg_quality: int = 75, group: int = 4,
               guidance: str = "batch", image_size: Optional[int] = None, mean=(0.5, 0.5, 0.5),
               std=(0.5, 0.5, 0.5), seed: int = 0):
    if unet is None:
      raise ValueError("dda reference: needs unet (a torch UNet, x_nchw, t -> NCHW)")
    self.model, self.unet = model.eval(), unet.eval()
    self.D, self.N, self.scale, self.group, self.guidance = D, N, scale, group, guidance
    self.jpeg_quality, self.image_size = jpeg_quality, image_size
    self.diffusion = SpacedDiffusion(1000, respacing)
    p = next(model.parameters())
    self.mean = torch.tensor(mean, device=p.device).view(1, -1, 1, 1)
    self.std = torch.tensor(std, device=p.device).view(1, -1, 1, 1)
    self.gen = torch.Generator(device=p.device).manual_seed(seed)

  def _resize(self, x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size:
      return x
    return F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False, antialias=True)

  def project(self, y: torch.Tensor) -> torch.Tensor:
    outs = []
    for g in range(0, y.shape[0], self.group):
      yg = y[g:g + self.group]
      noises = [torch.randn(yg.shape, generator=self.gen, device=y.device) for _ in range(self.N + 1)]
      outs.append(guided_sample(self.diffusion, self.unet, yg, noises, self.N, self.D, self.scale, self.guidance))
    return torch.cat(outs)

  def step(self, x: torch.Tensor) -> torch.Tensor:
    size = x.shape[-1]
    y = (x * self.std + self.mean) * 2 - 1
    y = self._resize(y, self.image_size or size).clamp(-1, 1)
    gen = self.project(y)
    if self.jpeg_quality:
      gen01 = jpeg_round_trip(gen, self.jpeg_quality)
    else:
      gen01 = ((gen + 1) / 2).clamp(0, 1)
    gen_x = (self._resize(gen01, size) - self.mean) / self.std
    with torch.no_grad():
      p = self.model(x).softmax(-1) + self.model(gen_x).softmax(-1)
    return torch.log(p / p.sum(-1, keepdim=True))

  def adapted_state(self) -> dict:
    return {}  # nothing adapts
