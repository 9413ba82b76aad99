"""pcsr_jax.augment: each op against torchvision / PIL for fixed parameters, and the pipelines' draws.

Tolerances (float32): torchvision tensor ops 1e-5 absolute (2e-5 for hue, through HSV); PIL 8-bit ops
exact, except autocontrast and the bilinear resamplers (PIL uses fixed-point weights), which may be
one level (1/255) off on a few pixels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax import augment as A
from pcsr_jax.augment import ops, pipelines, spa

torch_only = [pytest.mark.torch]  # torchvision comes with the convert extra


def _imgs(b=4, s=32, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), (b, s, s, 3))


def _tv():
  import torch
  import torchvision.transforms.functional as F
  return torch, F


def _to_t(x):
  import torch
  return torch.from_numpy(np.asarray(x)).permute(0, 3, 1, 2).contiguous()


def _from_t(t):
  return t.permute(0, 2, 3, 1).numpy()


# ------------------------------------------------------------------------------------------- torchvision

@pytest.mark.parametrize("op,tv,factor,tol", [
    (ops.adjust_brightness, "adjust_brightness", 1.3, 1e-6),
    (ops.adjust_contrast, "adjust_contrast", 0.7, 1e-6),
    (ops.adjust_saturation, "adjust_saturation", 1.45, 1e-6),
    (ops.adjust_hue, "adjust_hue", 0.06, 2e-5),
    (ops.adjust_hue, "adjust_hue", -0.1, 2e-5),
    (ops.adjust_gamma, "adjust_gamma", 0.75, 1e-6),
])
def test_colour_ops_match_torchvision(op, tv, factor, tol):
  torch, F = _tv()
  x = _imgs()
  want = _from_t(getattr(F, tv)(_to_t(x), factor))
  got = np.asarray(jax.jit(op)(x, factor))
  assert np.abs(got - want).max() < tol
  assert np.abs(got - np.asarray(x)).max() > 0.01  # the op did something


def test_grayscale_matches_torchvision():
  torch, F = _tv()
  x = _imgs()
  np.testing.assert_allclose(ops.grayscale(x), _from_t(F.rgb_to_grayscale(_to_t(x), 3)), atol=1e-6)


@pytest.mark.parametrize("k,sigma", [(5, 0.3), (5, 0.001), (13, 1.7)])
def test_gaussian_blur_matches_torchvision(k, sigma):
  torch, F = _tv()
  x = _imgs()
  want = _from_t(F.gaussian_blur(_to_t(x), [k, k], [sigma, sigma]))
  np.testing.assert_allclose(ops.gaussian_blur(x, k, sigma), want, atol=1e-6)


@pytest.mark.parametrize("angle,t,scale", [(12.3, (3.0, -2.0), 0.93), (-15.0, (0.0, 4.0), 1.1), (0.0, (0.0, 0.0), 1.0)])
def test_affine_matches_torchvision(angle, t, scale):
  torch, F = _tv()
  from torchvision.transforms import InterpolationMode
  x = _imgs(s=48)
  want = _from_t(F.affine(_to_t(x), angle=angle, translate=list(t), scale=scale, shear=[0.0, 0.0],
                          interpolation=InterpolationMode.BILINEAR))
  got = jax.vmap(lambda im: ops.affine_tv(im, angle, t, scale))(x)
  np.testing.assert_allclose(got, want, atol=1e-5)
  win = jax.vmap(lambda im: ops.affine_tv(im, angle, t, scale, out_rows=(10, 20)))(x)
  np.testing.assert_allclose(win, want[:, 10:30, 10:30], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [A.COTTA, A.ROID], ids=["cotta", "roid"])
def test_tta_pipeline_matches_torchvision_composition(cfg):
  """tta_apply with one drawn set of parameters == the official Compose written with torchvision's
  functional ops and the same parameters (padding, affine on the padded image, blur, centre crop)."""
  torch, F = _tv()
  from torchvision.transforms import InterpolationMode
  x = _imgs(s=32)
  for seed in range(3):
    d = jax.tree.map(np.asarray, pipelines.tta_draw(jax.random.PRNGKey(seed), cfg, 32, 32))
    got = np.asarray(jax.jit(lambda v: pipelines.tta_apply(v, d, cfg))(x))
    t = torch.clip(_to_t(x), 0, 1)
    f = [float(v) for v in d["factors"]]
    for i in d["order"]:
      t = [lambda y: F.adjust_brightness(y, f[0]), lambda y: F.adjust_contrast(y, f[1]),
           lambda y: F.adjust_saturation(y, f[2]), lambda y: F.adjust_hue(y, f[3]),
           lambda y: F.adjust_gamma(y.clamp(1e-8, 1.0), f[4])][int(i)](t)
    t = F.pad(t, 16, padding_mode=cfg.padding_mode)
    t = F.affine(t, angle=float(d["angle"]), translate=[int(d["tx"]), int(d["ty"])], scale=float(d["scale"]),
                 shear=[0.0, 0.0], interpolation=InterpolationMode.BILINEAR)
    if cfg.blur_sigma is not None:
      t = F.gaussian_blur(t, [5, 5], [float(d["sigma"])] * 2)
    t = F.center_crop(t, [32, 32])
    if d["flip"]:
      t = F.hflip(t)
    np.testing.assert_allclose(got, _from_t(t), atol=2e-5)


for _name in [n for n in list(globals()) if n.startswith("test_") and ("torchvision" in n or "composition" in n)]:
  for _m in torch_only:
    globals()[_name] = _m(globals()[_name])


# ------------------------------------------------------------------------------------------- PIL

def _u8(seed=0, s=24, lo=0, hi=256):
  return np.random.default_rng(seed).integers(lo, hi, (s, s, 3)).astype(np.uint8)


@pytest.mark.parametrize("name", ["autocontrast", "equalize", "solarize", "posterize"])
def test_pil_point_ops(name):
  from PIL import Image, ImageOps
  for seed, (lo, hi) in enumerate([(0, 256), (40, 200), (90, 93), (7, 8)]):
    a = _u8(seed, lo=lo, hi=hi)
    a[: seed + 2, :4] = 250  # a spike: uneven histograms for equalize
    im = Image.fromarray(a)
    want = np.asarray({"autocontrast": lambda: ImageOps.autocontrast(im), "equalize": lambda: ImageOps.equalize(im),
                       "solarize": lambda: ImageOps.solarize(im, 240), "posterize": lambda: ImageOps.posterize(im, 4)}[name]())
    q = jnp.asarray(a, jnp.float32)
    got = np.asarray({"autocontrast": ops.autocontrast, "equalize": ops.equalize,
                      "solarize": lambda v: ops.solarize(v, 240.0), "posterize": lambda v: ops.posterize(v, 4)}[name](q))
    assert np.abs(got - want).max() <= (1 if name == "autocontrast" else 0), (name, seed)


@pytest.mark.parametrize("kind,val", [("rotate", 2.0), ("rotate", -1.0), ("shear_x", 0.03), ("shear_y", -0.02),
                                      ("translate_x", 7.0), ("translate_y", -3.0)])
def test_pil_affine_ops(kind, val):
  from PIL import Image
  a = _u8(3, s=40)
  im = Image.fromarray(a)
  if kind == "rotate":
    want = im.rotate(val, resample=Image.BILINEAR, fillcolor=128)
    coeffs = ops.rotate_pil_coeffs(jnp.float32(val), 40, 40)
  else:
    c = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    c[{"shear_x": 1, "shear_y": 3, "translate_x": 2, "translate_y": 5}[kind]] = val
    want = im.transform((40, 40), Image.AFFINE, tuple(c), resample=Image.BILINEAR, fillcolor=128)
    coeffs = jnp.asarray(c, jnp.float32)
  got = np.asarray(ops.affine_pil(jnp.asarray(a, jnp.float32), coeffs))
  diff = np.abs(got - np.asarray(want).astype(np.float32))
  assert diff.max() <= 1 and (diff > 0).mean() < 0.02, (diff.max(), (diff > 0).mean())


@pytest.mark.parametrize("box", [(5, 7, 20, 31), (0, 0, 48, 48), (30, 2, 9, 40)])
def test_resized_crop_matches_pil(box):
  from PIL import Image
  a = _u8(4, s=48)
  top, left, h, w = box
  want = np.asarray(Image.fromarray(a).crop((left, top, left + w, top + h)).resize((32, 32), Image.BILINEAR))
  got = np.asarray(ops.resized_crop(jnp.asarray(a, jnp.float32) / 255.0, *map(jnp.float32, box), 32))
  diff = np.abs(got - want)
  assert diff.max() <= 1 and (diff > 0).mean() < 0.05, (diff.max(), (diff > 0).mean())


def test_random_resized_crop_box_is_valid():
  boxes = jax.vmap(lambda k: jnp.stack(ops.random_resized_crop_box(k, 32, 32)))(jax.random.split(jax.random.PRNGKey(0), 500))
  top, left, h, w = np.asarray(boxes).T
  assert (h >= 1).all() and (w >= 1).all() and (top + h <= 32).all() and (left + w <= 32).all() and (top >= 0).all()
  area = h * w / 1024
  assert area.min() > 0.05 and area.max() <= 1.0 and np.median(area) > 0.3
  assert len(np.unique(np.stack([top, left, h, w], 1), axis=0)) > 400


# ------------------------------------------------------------------------------------------- SPA

def _spa_mask_torch(keep, h, w):
  """SPA's Prompt mask construction, restated in torch on a given Bernoulli draw ``[B, C, H, W]``."""
  import torch
  ph, pw = max(int(h * 0.2), 1), max(int(w * 0.2), 1)
  padh, padw = (h - ph) // 2, (w - pw) // 2
  low = torch.nn.functional.pad(torch.ones(1, 3, ph, pw), [h - padh - ph, padh, w - padw - pw, padw])
  from benchmarks.torch_methods.spa import symmetric_mask

  return symmetric_mask(low * keep + (1 - low))


@pytest.mark.torch
@pytest.mark.parametrize("size", [32, 35])
def test_spa_amplitude_mask_matches_official_construction(size):
  import torch
  x = _imgs(b=3, s=size) * 2 - 1
  key = jax.random.PRNGKey(5)
  keep = np.asarray(jax.random.bernoulli(key, 0.8, x.shape), np.float32)
  mask = _spa_mask_torch(torch.from_numpy(keep).permute(0, 3, 1, 2).contiguous(), size, size)
  xt = _to_t(x).double()
  fft = torch.fft.fft2(xt, dim=(-2, -1))
  # SPA calls fftshift/ifftshift without dim=, shifting the batch and channel axes too; that only permutes
  # i.i.d. mask draws among samples and channels, so the spatial axes alone are shifted here.
  amp = torch.fft.ifftshift(torch.fft.fftshift(fft.abs(), dim=(-2, -1)) * mask.double(), dim=(-2, -1))
  want = _from_t(torch.fft.ifft2(torch.polar(amp, fft.angle()), dim=(-2, -1)).real.float())
  got = np.asarray(jax.jit(A.spa_amplitude_mask)(key, x))
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.abs(got - np.asarray(x)).max() > 0.01 and (np.asarray(mask) == 0).any()


def test_spa_amplitude_mask_identity_and_real():
  x = _imgs(b=2, s=32) * 2 - 1
  np.testing.assert_allclose(A.spa_amplitude_mask(jax.random.PRNGKey(0), x, keep_prob=1.0), x, atol=1e-5)
  m = spa._symmetric(jax.random.bernoulli(jax.random.PRNGKey(1), 0.5, (1, 33, 33, 1)).astype(jnp.float32))
  np.testing.assert_array_equal(m[0, :, :, 0], m[0, ::-1, ::-1, 0])  # point-symmetric about the centre


def test_spa_patch_noise():
  x = _imgs(b=3, s=32) * 2 - 1
  key = jax.random.PRNGKey(2)
  alpha = jnp.array([0.0, 0.5, 1.0, 0.3])
  got = np.asarray(A.spa_patch_noise(key, x, alpha))
  v = np.asarray(jax.random.normal(key, (32, 32, 3)))
  a2 = np.repeat(np.repeat(np.asarray(alpha).reshape(2, 2) ** 2, 16, 0), 16, 1)[None, :, :, None]
  np.testing.assert_allclose(got, np.clip((1 - a2) * np.asarray(x) + a2 * v, -1, 1), atol=1e-6)
  np.testing.assert_array_equal(got[:, :16, :16], np.asarray(x)[:, :16, :16])  # strength 0: untouched
  np.testing.assert_allclose(got[0, 16:, :16] - got[1, 16:, :16], 0, atol=1e-6)  # strength 1: shared noise
  g = jax.grad(lambda a: jnp.sum(A.spa_patch_noise(key, x, a) ** 2))(alpha)
  assert np.isfinite(g).all() and np.abs(g[1:]).min() > 0


# ------------------------------------------------------------------------------------------- pipelines

IDENTITY = A.TTAAugConfig(brightness=(1.0, 1.0), contrast=(1.0, 1.0), saturation=(1.0, 1.0), hue=(0.0, 0.0),
                          gamma=(1.0, 1.0), degrees=0.0, translate=0.0, scale=(1.0, 1.0), blur_sigma=None,
                          hflip_p=0.0, noise_std=0.0)


@pytest.mark.parametrize("mode", ["edge", "reflect"])
def test_tta_identity_at_zero_strength(mode):
  x = _imgs()
  cfg = dataclasses.replace(IDENTITY, padding_mode=mode)
  np.testing.assert_allclose(jax.jit(A.tta_augment, static_argnums=2)(jax.random.PRNGKey(0), x, cfg), x, atol=2e-6)
  blur0 = dataclasses.replace(cfg, blur_sigma=(1e-4, 1e-4))  # sigma -> 0: the 5-tap kernel is a delta
  np.testing.assert_allclose(A.tta_augment(jax.random.PRNGKey(0), x, blur0), x, atol=2e-6)


def test_shared_versus_per_sample_draws():
  same = jnp.broadcast_to(_imgs(b=1), (6, 32, 32, 3))
  key = jax.random.PRNGKey(3)
  no_noise = dataclasses.replace(A.COTTA, noise_std=0.0)
  spread = lambda y: float(jnp.abs(y - y[:1]).max())
  tta = jax.jit(A.tta_augment, static_argnums=(2, 3))
  assert spread(tta(key, same, no_noise, False)) < 1e-6  # one draw for the batch
  assert spread(tta(key, same, A.ROID, False)) < 1e-6
  assert spread(tta(key, same, no_noise, True)) > 0.05
  assert spread(jax.jit(A.adacontrast_strong)(key, same)) > 0.05
  noisy = tta(key, same, A.COTTA, False)  # the noise is per element even with a shared draw
  assert 1e-3 < spread(noisy) < 0.05


def test_weak_view_flips_per_sample():
  x = jnp.broadcast_to(_imgs(b=1), (16, 32, 32, 3))
  y = A.adacontrast_weak(jax.random.PRNGKey(0), x)
  flipped = np.asarray(jnp.all(y == x[:, :, ::-1], axis=(1, 2, 3)))
  kept = np.asarray(jnp.all(y == x, axis=(1, 2, 3)))
  assert (flipped | kept).all() and 0 < flipped.sum() < 16


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cotta", "roid", "strong", "augmix", "amp", "noise"])
def test_determinism_ranges_and_jit(name):
  x = _imgs()
  fn = {"cotta": A.cotta_augment, "roid": A.roid_augment, "strong": A.adacontrast_strong,
        "augmix": lambda k, v: A.augmix_views(k, v[0], 5),
        "amp": A.spa_amplitude_mask, "noise": lambda k, v: A.spa_patch_noise(k, v, jnp.full(4, 0.4 ** 0.5))}[name]
  f = jax.jit(fn)
  a, b, c = f(jax.random.PRNGKey(0), x), f(jax.random.PRNGKey(0), x), f(jax.random.PRNGKey(1), x)
  np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(a - c).max()) > 1e-3
  assert a.dtype == jnp.float32 and a.shape == ((5, 32, 32, 3) if name == "augmix" else x.shape)
  if name not in ("amp", "noise"):
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0
  if name == "augmix":  # views of one image, each its own draw
    assert len({round(float(v.mean()), 5) for v in np.asarray(a)}) == 5


def test_augmix_ops_dispatch():
  """Each AugMix op index applies the named op (the point ops are checked against PIL above)."""
  q = ops.quantize(_imgs(b=1)[0])
  key = jax.random.PRNGKey(0)
  run = jax.jit(pipelines._augmix_op)
  np.testing.assert_array_equal(run(key, q, 0), ops.autocontrast(q))
  np.testing.assert_array_equal(run(key, q, 1), ops.equalize(q))
  np.testing.assert_array_equal(run(key, q, 8), ops.posterize(q, 4))
  np.testing.assert_array_equal(run(key, q, pipelines.IDENTITY_OP), q)  # a chain step past the chain's depth
  for op in range(2, 8):
    out = np.asarray(run(key, q, op))
    assert np.isin(out, np.arange(256)).all() and out.shape == q.shape


def test_augmix_views_loop_and_vectorised_agree():
  """The CPU's loop (each chain step runs its own op) and the accelerators' vectorised select make the same
  draws and the same 8-bit chains; XLA fuses the final float mix differently, so the views agree to float32
  rounding (2 ulps of 1.0). Within the loop, a rerun is bit-identical."""
  img = _imgs(b=1)[0]
  key = jax.random.PRNGKey(7)
  keys = jax.random.split(key, 6)
  draw = jax.jit(jax.vmap(lambda k: pipelines._augmix_draw(k, img, 32)))
  crops, _, _, chain_keys = draw(keys)
  one = jax.jit(lambda k, c: pipelines._augmix_chain(k, c))
  looped_chains = np.stack([np.stack([np.asarray(one(k, c)) for k in ks]) for ks, c in zip(chain_keys, crops)])
  vec_chains = jax.jit(jax.vmap(jax.vmap(pipelines._augmix_chain, in_axes=(0, None))))(chain_keys, crops)
  np.testing.assert_array_equal(looped_chains, np.asarray(vec_chains))  # the ops on integer levels: exact
  assert len({float(np.abs(c[0] - c[1]).sum()) for c in looped_chains}) == 6  # chains differ from each other

  looped = jax.jit(lambda k: A.augmix_views(k, img, 6, loop=True))(key)
  vectorised = jax.jit(lambda k: A.augmix_views(k, img, 6, loop=False))(key)
  np.testing.assert_allclose(np.asarray(looped), np.asarray(vectorised), rtol=0, atol=2.5e-7)
  assert len({round(float(v.mean()), 5) for v in np.asarray(looped)}) == 6
  default = jax.jit(lambda k: A.augmix_views(k, img, 6))(key)  # the CPU backend picks the loop
  np.testing.assert_array_equal(np.asarray(default), np.asarray(looped))


def test_normalize_round_trip():
  x = _imgs()
  mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
  np.testing.assert_allclose(A.denormalize(A.normalize(x, mean, std), mean, std), x, atol=1e-6)
  np.testing.assert_allclose(A.normalize(x, (0.5,) * 3, (0.5,) * 3), 2 * x - 1, atol=1e-6)


SHARDED_SCRIPT = r"""
import json, re, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
jax.config.update("jax_num_cpu_devices", 2)
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pcsr_jax import augment as A
rows = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec("data"))
x = np.random.default_rng(0).uniform(size=(8, 32, 32, 3)).astype(np.float32)
out = {}
for name, fn in [("cotta", A.cotta_augment), ("roid", A.roid_augment), ("strong", A.adacontrast_strong)]:
  f = jax.jit(fn, out_shardings=rows)
  placed = jax.device_put(x, rows)
  hlo = f.lower(jax.random.key(1), placed).compile().as_text()
  sharded = np.asarray(f(jax.random.key(1), placed))
  whole = np.asarray(jax.jit(fn)(jax.random.key(1), x))
  out[name] = dict(collectives=sorted(set(re.findall(r"(all-reduce|all-gather|all-to-all|collective-permute)\(", hlo))),
                   diff=float(np.abs(sharded - whole).max()))
print(json.dumps(out))
"""


def test_batch_augmentations_stay_on_each_devices_rows():
  """On a batch sharded over 2 devices, the one-draw (CoTTA, ROID) and per-sample (AdaContrast) pipelines
  compile without any cross-device communication and give the one-device result up to float32 rounding
  (XLA fuses the per-image reductions, the contrast's mean among them, differently for 4 rows). The hue
  op once used ``jnp.choose``, a gather whose indices XLA's partitioner gathered from the whole batch onto
  every device (then summed the outputs across them): ROID's augmentation took twice as long on 2 devices."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, root], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert sorted(out) == ["cotta", "roid", "strong"], out
  for name, o in out.items():
    assert o["collectives"] == [] and o["diff"] < 1e-5, (name, o)
