"""The baselines' augmentation pipelines, seeded and jit-able, on ``[B, H, W, C]`` pixels in [0, 1].

- :func:`tta_augment` with :data:`COTTA` / :data:`ROID`: CoTTA's ``get_tta_transforms``
  (``qinenergy/cotta:imagenet/cotta.py``, ``my_transforms.py``; its ``cifar/cotta.py`` is the same pipeline
  at 32 px, padding ``H // 2`` as here) and ROID's ``cotta_augs=False`` variant
  (DT ``classification/augmentations/transforms_cotta.py``, used by ``methods/roid.py``).
- :func:`adacontrast_strong` / :func:`adacontrast_weak`: DT ``transforms_adacontrast.py`` "moco-v2-light" and
  "plain" at ``res_size = crop_size = input size`` (its ImageNet-C setting).
- :func:`dept_weak` / :func:`dept_strong`: DePT's ``DataAugmentationDINO`` weak and global views
  (``yhygao/DePT:model/dept_dino.py``).
- :func:`augmix_views`: MEMO's ``RandomResizedCrop + flip + AugMix`` (``zhangmarvin/memo:
  imagenet-exps/utils/third_party.py``), V views of one image.

Images going to a model are normalised; use :func:`~pcsr_jax.augment.ops.denormalize` first and
:func:`~pcsr_jax.augment.ops.normalize` after, as the official pipelines augment unnormalised pixels.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pcsr_jax.augment import ops

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TTAAugConfig:
  """CoTTA-style test-time augmentation (defaults: CoTTA's non-"soft" ImageNet values).

  Order: clip; colour jitter (the five ops in a random order); pad by ``H // 2`` (``padding_mode``);
  random affine (degrees, translate as a fraction of the PADDED size rounded to whole pixels, scale;
  bilinear); Gaussian blur (``blur_kernel``, sigma ~ U(blur_sigma); None = no blur); centre crop back
  to ``H x W``; h-flip with ``hflip_p``; additive N(0, noise_std) noise (0 = none); clip.
  """
  brightness: tuple[float, float] = (0.6, 1.4)
  contrast: tuple[float, float] = (0.7, 1.3)
  saturation: tuple[float, float] = (0.5, 1.5)
  hue: tuple[float, float] = (-0.06, 0.06)
  gamma: tuple[float, float] = (0.7, 1.3)
  padding_mode: str = "edge"
  degrees: float = 15.0
  translate: float = 1.0 / 16.0
  scale: tuple[float, float] = (0.9, 1.1)
  blur_sigma: Optional[tuple[float, float]] = (0.001, 0.5)
  blur_kernel: int = 5
  hflip_p: float = 0.5
  noise_std: float = 0.005


COTTA = TTAAugConfig()
# DT get_tta_transforms(padding_mode="reflect", cotta_augs=False): no blur, no noise, reflect padding.
ROID = TTAAugConfig(padding_mode="reflect", blur_sigma=None, noise_std=0.0)


def _uniform(key: Array, lo_hi: tuple[float, float]) -> Array:
  return jax.random.uniform(key, (), minval=lo_hi[0], maxval=lo_hi[1])


def tta_draw(key: Array, cfg: TTAAugConfig, h: int, w: int) -> dict[str, Array]:
  """One draw of the pipeline's random parameters for ``H x W`` images (torchvision's ``get_params``)."""
  ks = jax.random.split(key, 12)
  p = h // 2
  hp, wp = h + 2 * p, w + 2 * p
  return dict(
      factors=jnp.stack([_uniform(ks[i], r) for i, r in enumerate(
          (cfg.brightness, cfg.contrast, cfg.saturation, cfg.hue, cfg.gamma))]),
      order=jax.random.permutation(ks[5], 5),  # ColorJitterPro.forward: torch.randperm(5)
      angle=_uniform(ks[6], (-cfg.degrees, cfg.degrees)),
      # RandomAffine.get_params: translate is a fraction of the (padded) image, rounded to whole pixels.
      tx=jnp.round(_uniform(ks[7], (-cfg.translate * wp, cfg.translate * wp))),
      ty=jnp.round(_uniform(ks[8], (-cfg.translate * hp, cfg.translate * hp))),
      scale=_uniform(ks[9], cfg.scale),
      sigma=_uniform(ks[10], cfg.blur_sigma) if cfg.blur_sigma is not None else jnp.zeros(()),
      flip=jax.random.uniform(ks[11]) < cfg.hflip_p)


def tta_apply(x: Array, d: dict[str, Array], cfg: TTAAugConfig) -> Array:
  """The pipeline up to (not including) the noise and final clip, with drawn parameters ``d``, on
  ``x`` = one ``[H, W, C]`` image or a batch that shares the draw."""
  f = d["factors"]
  branches = [
      lambda y: ops.adjust_brightness(y, f[0]),
      lambda y: ops.adjust_contrast(y, f[1]),
      lambda y: ops.adjust_saturation(y, f[2]),
      lambda y: ops.adjust_hue(y, f[3]),
      # my_transforms.ColorJitterPro clamps to [1e-8, 1] right before gamma (NaN-free gradients).
      lambda y: ops.adjust_gamma(jnp.clip(y, 1e-8, 1.0), f[4]),
  ]
  x = jnp.clip(x, 0.0, 1.0)
  order = jnp.asarray(d["order"])
  x = jax.lax.fori_loop(0, 5, lambda i, y: jax.lax.switch(order[i], branches, y), x)
  h = x.shape[-3]  # square images (the ViT input): the centre crop below uses one offset for both axes
  p = h // 2  # transforms.Pad(int(n_pixels / 2))
  x = ops.pad(x, p, cfg.padding_mode)
  # Only the centre crop (plus the blur's reach) of the affine output is ever used: compute that window.
  r = cfg.blur_kernel // 2 if cfg.blur_sigma is not None else 0
  top = int(round((h + 2 * p - h) / 2.0))  # CenterCrop
  affine = lambda img: ops.affine_tv(img, d["angle"], (d["tx"], d["ty"]), d["scale"],
                                     out_rows=(top - r, h + 2 * r))
  x = affine(x) if x.ndim == 3 else jax.vmap(affine)(x)
  if cfg.blur_sigma is not None:
    x = ops.gaussian_blur(x, cfg.blur_kernel, d["sigma"], padding="valid")
  return jnp.where(d["flip"], ops.hflip(x), x)


def tta_augment(key: Array, x01: Array, cfg: TTAAugConfig = COTTA, per_sample: bool = False) -> Array:
  """CoTTA/ROID augmentation of a batch ``[B, H, W, C]`` in [0, 1] -> same shape, in [0, 1].

  ``per_sample=False`` (the official behaviour of both CoTTA and ROID, whose transforms run on the
  batch tensor) draws ONE set of parameters for the whole batch; the contrast mean and the noise are
  still per image / per element, as in torchvision. ``per_sample=True`` draws per image.
  """
  b, h, w, _ = x01.shape
  if h != w:
    raise ValueError(f"tta_augment needs square images, got {h}x{w}")
  if h // 2 < cfg.blur_kernel // 2:
    raise ValueError(f"images of {h} px are too small for a {cfg.blur_kernel}-tap blur after padding")
  k_draw, k_noise = jax.random.split(key)
  if per_sample:
    y = jax.vmap(lambda k, img: tta_apply(img, tta_draw(k, cfg, h, w), cfg))(jax.random.split(k_draw, b), x01)
  else:
    y = tta_apply(x01, tta_draw(k_draw, cfg, h, w), cfg)
  if cfg.noise_std > 0:
    y = y + cfg.noise_std * jax.random.normal(k_noise, y.shape, y.dtype)
  return jnp.clip(y, 0.0, 1.0)


def cotta_augment(key: Array, x01: Array, cfg: TTAAugConfig = COTTA) -> Array:
  """CoTTA's augmentation: one draw shared by the batch (``qinenergy/cotta`` applies it to the batch)."""
  return tta_augment(key, x01, cfg, per_sample=False)


def roid_augment(key: Array, x01: Array, cfg: TTAAugConfig = ROID) -> Array:
  """ROID's consistency augmentation. DT's ``roid.py`` calls ``self.tta_transform(imgs_test[~mask])`` on
  the batch tensor, so the draw is shared by the batch, as here."""
  return tta_augment(key, x01, cfg, per_sample=False)


# ---------------------------------------------------------------- AdaContrast (DT transforms_adacontrast.py)

ADACONTRAST_BLUR_TAPS = 13  # covers +-3 sigma at sigma = 2


def _adacontrast_strong_one(key: Array, img: Array) -> Array:
  ks = jax.random.split(key, 12)
  # transforms.ColorJitter(0.4, 0.4, 0.4, 0.1): factors U(0.6, 1.4) x3, hue U(-0.1, 0.1), random order.
  f = [_uniform(ks[i], (0.6, 1.4)) for i in range(3)] + [_uniform(ks[3], (-0.1, 0.1))]
  branches = [lambda y: ops.adjust_brightness(y, f[0]), lambda y: ops.adjust_contrast(y, f[1]),
              lambda y: ops.adjust_saturation(y, f[2]), lambda y: ops.adjust_hue(y, f[3])]
  order = jax.random.permutation(ks[4], 4)
  jit = jax.lax.fori_loop(0, 4, lambda i, y: jax.lax.switch(order[i], branches, y), img)
  img = jnp.where(jax.random.uniform(ks[5]) < 0.8, jit, img)  # RandomApply(p=0.8)
  img = jnp.where(jax.random.uniform(ks[6]) < 0.2, ops.grayscale(img), img)  # RandomGrayscale(0.2)
  sigma = _uniform(ks[7], (0.1, 2.0))
  blurred = ops.gaussian_blur(img, ADACONTRAST_BLUR_TAPS, sigma)
  img = jnp.where(jax.random.uniform(ks[8]) < 0.5, blurred, img)  # RandomApply(GaussianBlur, p=0.5)
  return jnp.where(jax.random.uniform(ks[9]) < 0.5, ops.hflip(img), img)


def adacontrast_strong(key: Array, x01: Array) -> Array:
  """AdaContrast's strong view ("moco-v2-light"), an independent draw per sample, ``[B, H, W, C]``.

  ColorJitter(0.4, 0.4, 0.4, 0.1) with p 0.8, grayscale p 0.2, Gaussian blur sigma ~ U(0.1, 2) with
  p 0.5, h-flip p 0.5. ``Resize((res, res))`` is the identity at DT's ImageNet-C/CIFAR sizes
  (res = input size) and is omitted. DT runs these on PIL images: the colour ops here use torchvision's
  tensor formulas (no 8-bit rounding) and the blur is an exact Gaussian (13 taps, reflect padding)
  where PIL's ``GaussianBlur(radius=sigma)`` approximates one with three box blurs.
  """
  return jax.vmap(_adacontrast_strong_one)(jax.random.split(key, x01.shape[0]), x01)


def adacontrast_weak(key: Array, x01: Array) -> Array:
  """AdaContrast's weak view ("plain": Resize(res) + RandomCrop(crop) + h-flip), per sample. At DT's
  ImageNet-C/CIFAR setting res = crop = input size, so only the flip (p 0.5) remains."""
  flip = jax.random.uniform(key, (x01.shape[0], 1, 1, 1)) < 0.5
  return jnp.where(flip, ops.hflip(x01), x01)


# ---------------------------------------------------------------- DePT (yhygao/DePT model/dept_dino.py)

def _dept_weak_one(key: Array, img: Array, resize: int) -> Array:
  k_top, k_left, k_flip = jax.random.split(key, 3)
  h, w, _ = img.shape
  zero = jnp.zeros((), jnp.float32)
  big = ops.resized_crop(img, zero, zero, zero + h, zero + w, resize) / 255.0  # Resize((r, r)): PIL bilinear
  top = jax.random.randint(k_top, (), 0, resize - h + 1)
  left = jax.random.randint(k_left, (), 0, resize - w + 1)
  crop = jax.lax.dynamic_slice(big, (top, left, 0), img.shape)
  return jnp.where(jax.random.uniform(k_flip) < 0.5, ops.hflip(crop), crop)


def dept_weak(key: Array, x01: Array, resize: int) -> Array:
  """DePT's weak view (``DataAugmentationDINO.weak_transfo``): ``Resize((resize, resize))`` (PIL bilinear,
  8-bit levels), ``RandomCrop`` back to the input size, h-flip p 0.5; an independent draw per sample. The
  official size is 256 for 224 px input."""
  return jax.vmap(lambda k, x: _dept_weak_one(k, x, resize))(jax.random.split(key, x01.shape[0]), x01)


def dept_strong(key: Array, x01: Array, scale: tuple[float, float] = (0.2, 1.0)) -> Array:
  """DePT's strong view (``DataAugmentationDINO.global_transfo``): ``RandomResizedCrop(S, scale)`` then
  h-flip, ColorJitter(0.4, 0.4, 0.4, 0.1) p 0.8, greyscale p 0.2, Gaussian blur sigma U(0.1, 2) p 0.5: AdaContrast's
  strong view (the same ops and probabilities; the flip commutes with them) after the crop. The crop
  resamples with PIL's antialiased bilinear filter where the official uses bicubic."""
  size = x01.shape[1]

  def one(k, img):
    k_crop, k_rest = jax.random.split(k)
    top, left, ch, cw = ops.random_resized_crop_box(k_crop, img.shape[0], img.shape[1], scale=scale)
    return _adacontrast_strong_one(k_rest, ops.resized_crop(img, top, left, ch, cw, size) / 255.0)

  return jax.vmap(one)(jax.random.split(key, x01.shape[0]), x01)


# ---------------------------------------------------------------- MEMO: RandomResizedCrop + flip + AugMix

AUGMIX_OPS = ("autocontrast", "equalize", "rotate", "solarize", "shear_x", "shear_y",
              "translate_x", "translate_y", "posterize")


IDENTITY_OP = len(AUGMIX_OPS)  # the op index of a chain step past the chain's depth


# Op index -> the branch that computes it: the five geometric ops (rotate, shear x/y, translate x/y) are one
# PIL affine with op-dependent coefficients, so a vectorised select computes one affine, not five.
_AUGMIX_BRANCH = (0, 1, 2, 3, 2, 2, 2, 2, 4, 5)
_AUGMIX_COEFFS = (0, 0, 0, 0, 1, 2, 3, 4, 0, 0)  # op -> row of the affine coefficients below


def _augmix_op(key: Array, q: Array, op: Array) -> Array:
  """AugMix op number ``op`` (:data:`AUGMIX_OPS`; :data:`IDENTITY_OP` = none) at severity 1 on 8-bit levels
  ``[S, S, C]``.

  Magnitudes (``third_party.py``): level u ~ U(0.1, 1); rotate int(3u) degrees, solarize threshold
  256 - int(25.6u), shear u*0.03, translate int(u*size/30) px (MEMO hard-codes size 224), each with
  a random sign; posterize to 4 - int(0.4u) = 4 bits. ``lax.switch`` runs only the chosen branch as long as
  ``op`` is not batched; under ``jax.vmap`` over views it becomes a select over the six branches' results.
  """
  s = q.shape[0]
  k_u, k_sign = jax.random.split(key)
  u = jax.random.uniform(k_u, (), minval=0.1, maxval=1.0)
  sign = jnp.where(jax.random.uniform(k_sign) > 0.5, -1.0, 1.0)
  shear = sign * u * 0.03
  shift = sign * jnp.floor(u * (s / 3.0) / 10.0)
  eye = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
  # rotate int(3u) in {0, 1, 2} degrees with a sign: five angles, whose coefficients come from a table (in
  # float64, as PIL computes them) so that a batched and an unbatched cos/sin cannot round differently.
  rotations = np.stack([np.asarray(ops.rotate_pil_coeffs(np.float64(d), s, s, xp=np), np.float32)
                        for d in range(-2, 3)])
  coeffs = jnp.stack([
      jnp.asarray(rotations)[(sign * jnp.floor(u * 3.0)).astype(jnp.int32) + 2],
      eye.at[1].set(shear), eye.at[3].set(shear),
      eye.at[2].set(shift), eye.at[5].set(shift)])[jnp.array(_AUGMIX_COEFFS)[op]]
  threshold = 256.0 - jnp.floor(u * 25.6)
  branches = [ops.autocontrast, ops.equalize, lambda x: ops.affine_pil(x, coeffs),
              lambda x: ops.solarize(x, threshold), lambda x: ops.posterize(x, 4), lambda x: x]
  return jax.lax.switch(jnp.array(_AUGMIX_BRANCH)[op], branches, q)


def _augmix_draw(key: Array, img01: Array, size: int) -> tuple[Array, Array, Array, Array]:
  """One view's crop (8-bit levels, flipped or not), chain weights, mix weight and chain keys."""
  h, w, _ = img01.shape
  k_crop, k_flip, k_w, k_m, k_chain = jax.random.split(key, 5)
  top, left, ch, cw = ops.random_resized_crop_box(k_crop, h, w)
  crop = ops.resized_crop(img01, top, left, ch, cw, size)  # PIL RandomResizedCrop, 8-bit levels
  crop = jnp.where(jax.random.uniform(k_flip) < 0.5, ops.hflip(crop), crop)
  weights = jax.random.dirichlet(k_w, jnp.ones(3))
  m = jax.random.beta(k_m, 1.0, 1.0)
  return crop, weights, m, jax.random.split(k_chain, 3)


def _augmix_chain(key: Array, crop: Array) -> Array:
  """One AugMix chain: 1-3 ops (``np.random.randint(1, 4)``) drawn uniformly, applied in turn."""
  k_depth, k_ops, k_lvls = jax.random.split(key, 3)
  depth = jax.random.randint(k_depth, (), 1, 4)
  chosen = jax.random.randint(k_ops, (3,), 0, len(AUGMIX_OPS))
  chosen = jnp.where(jnp.arange(3) < depth, chosen, IDENTITY_OP)
  step = lambda x, op_key: (_augmix_op(op_key[1], x, op_key[0]), None)
  return jax.lax.scan(step, crop, (chosen, jax.random.split(k_lvls, 3)))[0]


def augmix_views(key: Array, img01: Array, n_views: int, size: Optional[int] = None,
                 loop: Optional[bool] = None, platform: str = "cpu") -> Array:
  """MEMO's ``n_views`` augmented views of ONE image ``[H, W, C]`` in [0, 1] -> ``[V, S, S, C]``.

  Per view: RandomResizedCrop(S, scale 0.08-1, ratio 3/4-4/3; PIL bilinear) to 8-bit, h-flip p 0.5,
  then AugMix: 3 chains of 1-3 ops drawn uniformly from :data:`AUGMIX_OPS`, chain weights ~
  Dirichlet(1, 1, 1), m ~ Beta(1, 1), output m * crop + (1 - m) * sum_i w_i chain_i. MEMO mixes the
  normalised tensors; normalisation is affine and the weights sum to 1, so mixing [0, 1] pixels and
  normalising after is the same. The views never include the un-augmented image. ``S`` defaults to H.

  ``loop``: run the chains one after the other, so each chain step runs only its own op (a chain has 1-3
  steps), or vectorised, where each of a view's 3 x 3 steps computes every op and selects. The same draws
  and the same 8-bit crops and chains either way; the final mix, fused differently, can differ by a float32
  ulp (``tests/test_augment.py``). ``None``: loop on the CPU, where it is about 5x faster (64 views at 224 px
  on 2 cores: 0.41 s against 2.20 s, ``python -m benchmarks.augmix_views``; ``equalize``'s histogram
  dominates the vectorised form), vectorise on accelerators, where 192 sequential chains per image would
  cost more than the discarded arithmetic; ``platform`` is the one the program is built for
  (`pcsr_jax.platforms`, a method's ``Prepared.platform``).
  """
  return augmix_views_of_keys(jax.random.split(key, n_views), img01, size, loop, platform)


def augmix_views_of_keys(keys: Array, img01: Array, size: Optional[int] = None,
                         loop: Optional[bool] = None, platform: str = "cpu") -> Array:
  """:func:`augmix_views` with one key per view (``keys[i]`` draws view ``i``), so that a subset of the keys
  draws the same subset of views: a device can draw its own share."""
  size = img01.shape[0] if size is None else size
  loop = platform == "cpu" if loop is None else loop
  crops, weights, m, chain_keys = jax.vmap(lambda k: _augmix_draw(k, img01, size))(keys)
  each = (lambda f: lambda xs: jax.lax.map(f, xs)) if loop else jax.vmap
  chains = each(lambda kc: each(lambda k: _augmix_chain(k, kc[1]))(kc[0]))((chain_keys, crops))  # [V, 3, ...]
  mix = jnp.einsum("vi,vihwc->vhwc", weights, chains)
  return (m[:, None, None, None] * crops + (1.0 - m[:, None, None, None]) * mix) / 255.0
