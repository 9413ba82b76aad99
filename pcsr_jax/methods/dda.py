"""DDA (Gao et al., CVPR 2023, "Back to the Source: Diffusion-Driven Test-Time Adaptation"): no weights adapt;
each test image is projected towards the source domain by a diffusion model, and the classifier's outputs on
the input and on the projection are ensembled.

Official code: ``shiyegao/DDA`` on OpenAI's ``guided-diffusion``: ``image_adapt.sh`` (the flags),
``image_adapt/scripts/image_sample.py``, ``image_adapt/guided_diffusion/gaussian_diffusion.py``
(``p_sample_loop_progressive``), ``respace.py``, ``image_adapt/resize_right.py``, ``image_datasets.py``, and the
classifier side ``model_adapt/test_ensemble.py``, ``evaluation.py`` and the mmcls configs. What it does per
batch (`pcsr_jax.diffusion` has the maths):

1. The image ``y`` in [-1, 1] at the UNet's size is noised with ``q_sample`` to respaced index ``N`` (50 of the
   "100" respacing: original t = 505), then ``N`` guided DDPM steps run at indices ``N - 1 .. 0`` (the official
   off-by-one, kept: `diffusion.guided_sample`). Each step: the UNet at the original timestep, learned-range
   variance, x0 clipped to [-1, 1], the ancestral sample, then ``x -= scale * d||phi_D(y) - phi_D(x0_hat)|| /
   dx_t`` with ``phi_D = up_D(down_D(.))`` (resize_right's cubic antialiased resize).
2. The classifier runs on the input and on the projection; the reported prediction is their ensemble
   (``--ensemble sum``: the sum of the two softmax outputs).

Fields: ``unet`` (a diffusion checkpoint folder: `pcsr_jax.checkpoint.load` gives ``(UNet, params, meta)``;
convert OpenAI's ``256x256_diffusion_uncond.pt`` with ``convert_weights.py``), ``D`` 4, ``N`` 50, ``scale`` 6,
``respacing`` "100" (``image_adapt.sh``; the argparse defaults D=32, scale=1 are not what the script runs),
``jpeg_quality`` 75, ``guidance``, ``group``, ``ensemble``, and ``mean``/``std`` (the classifier checkpoint's,
filled in by the harness).

Departures from the official code, each deliberate:

* Input. The harness hands the method the classifier's normalized NHWC images at the classifier's size
  (ImageNet-C: its 224 px JPEG as it is). They are mapped back to [0, 1] with ``mean``/``std``, then to [-1, 1];
  when the UNet's ``image_size`` differs (224 -> 256 for OpenAI's model) they are resized with
  ``jax.image.resize`` 'cubic' (Keys' a = -0.5 kernel, antialiased when shrinking) on floats and clipped to
  [-1, 1]. The official resizes the uint8 JPEG with PIL's bicubic (``center_crop_arr``), so its input also
  carries 8-bit rounding after the resize.
* Classifier views. The official classifier sees ``Resize(256) + CenterCrop(224)`` of both the input and the
  generated image (mmcls configs). Here the input branch is the harness's image (what every other method
  predicts on), and the generated image is resized back from the UNet's size to the classifier's (cubic,
  antialiased), so both branches have the same framing; no centre crop.
* JPEG. The official writes the projection with ``torchvision.utils.save_image`` (clamp to [-1, 1], to [0, 1],
  ``floor(255 x + 0.5)`` as uint8) under the ``.JPEG`` name, so PIL saves a JPEG at its default quality 75, and
  the classifier reads that file. Here the same quantisation and a PIL JPEG round trip at ``jpeg_quality``
  (PIL's defaults otherwise) run on the host through ``jax.pure_callback`` on a CPU: one device -> host ->
  device copy of the projections per batch, outside any gradient. On a GPU or TPU the round trip is the
  corruption stream's jitted libjpeg codec (`corrupt_device.jpeg`), on the device (`jpeg_round_trip`; ``jpeg``
  picks either anywhere). Its distance to PIL's: `python -m benchmarks.dda_jpeg`.
  ``jpeg_quality`` 0 skips both the JPEG and the 8-bit rounding (the float projection goes to the classifier).
* Batches. The official guidance norm spans the per-GPU batch (4 images in ``image_adapt.sh``), which couples
  the images of a batch: each image's step is scaled by ``||diff_b|| / ||diff||``. Here the harness's batch is
  cut into groups of ``group`` images (default 4), run one after the other on a CPU (``lax.map``: each group is
  one UNet batch) and all at once on a GPU or TPU (``vmap``: one UNet batch of the whole batch, as the
  official's GPUs run theirs side by side); each group is, under ``guidance='batch'``, one norm, so the coupling
  matches the official's at the script's batch size whatever the harness's batch size is. ``guidance='image'``
  takes one norm per image (no coupling). Padded rows of a ragged last batch stay out of every norm. The images' grouping follows the stream's order (the
  official's follows its data loader's).
* Noise comes from JAX keys (the state's rng, split per batch, per group and per step): a run is deterministic
  for a seed. The official sets no seed.
* Ensemble. mmcls returns softmax probabilities ``p1`` (input) and ``p2`` (projection); ``ensemble`` picks the
  official combination: 'sum' ``p1 + p2``; 'first' / 'second' one of them; 'entropy', 'confidence', 'var' the
  one with the lower entropy / higher confidence / higher variance; 'entropy_sum' ``p1 * H2 + p2 * H1``;
  'confidence_sum' ``p1 * c1 + p2 * c2``. As the official, the entropies and confidences are those of
  ``softmax(p)``, a softmax of the probabilities. The '*_fuse' modes (a third forward on a pixel blend) are not
  offered. The returned "logits" are ``log(score / sum(score))``: the same argmax as the official's score, and a
  proper distribution under softmax.
* The UNet runs in the dtype its checkpoint's config names (float32 by default; the official runs its
  convolutions in fp16). On a CPU backend its convolutions run as im2col matmuls (`pcsr_jax.models.unet.Conv`
  'dots') and its GroupNorms from per-channel sums with a closed-form backward (`pcsr_jax.models.unet.group_norm`,
  'sums'): the same values up to float32 summation order, 3x faster together inside the sampler's loop (126
  against 376 ms per group of 4 and guided step on one device: `python -m benchmarks.dda_projection`).

Eval order: the prediction is made inside `DDA.update` (nothing adapts, so "after" would be the source model's):
``eval_orders = ("before",)``, as MEMO's. Cost per image: ``N`` UNet forwards and ``N`` UNet backwards to the
input (the guidance gradient), plus two classifier forwards; about 235 TFLOP per image with OpenAI's 256 px
model, a GPU-only job at ImageNet scale.

For tests and references: `DDA.prepare_with` takes the UNet as a module, params and metadata (any Flax module
``apply({'params': p}, x_nhwc, t_int) -> NHWC output``), `DDA.project` runs the projection alone, `ensemble`
combines logits.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any, ClassVar, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from pcsr_jax import augment, diffusion, losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared
from pcsr_jax.methods.hyperparameters import field

Array = jax.Array

ENSEMBLES = ("sum", "first", "second", "entropy", "confidence", "var", "entropy_sum", "confidence_sum")
MAKE_ONE = ("convert OpenAI's 256x256_diffusion_uncond.pt with convert_weights.py MODEL.pt --out DIR --unet-config "
            "256x256_diffusion_uncond, then pass --method-args '{\"dda\": {\"unet\": \"DIR\"}}'")


@dataclasses.dataclass(frozen=True)
class DDAPrepared(Prepared):
  """`Prepared` plus what DDA's step needs besides the classifier: the UNet module (its params are
  ``consts['unet']``, placed by the engine like any other read-only array), the respaced `diffusion.Schedule`,
  whether the UNet learns its variance, and its image size."""

  unet: Optional[nn.Module] = None
  schedule: Optional[diffusion.Schedule] = None
  learn_sigma: bool = True
  unet_size: int = 0


def diffusion_settings(meta: Mapping[str, Any]) -> tuple[int, str, bool]:
  """``(diffusion_steps, noise_schedule, learn_sigma)`` of a diffusion checkpoint's metadata (its ``diffusion``
  record; guided-diffusion's defaults where a key is absent: 1000, 'linear', True)."""
  d = meta.get("diffusion", {})
  return int(d.get("diffusion_steps", 1000)), str(d.get("noise_schedule", "linear")), bool(d.get("learn_sigma", True))


def ensemble(logits_input: Array, logits_generated: Array, mode: str) -> Array:
  """DDA's ``--ensemble`` of the classifier's outputs on the input and on the projection, as log-probabilities
  (see the module docstring): ``[B, C]`` -> ``[B, C]``."""
  p1, p2 = jax.nn.softmax(logits_input, -1), jax.nn.softmax(logits_generated, -1)
  ent = lambda p: losses.entropy(p)[:, None]  # of softmax(p), as the official's ``logits.softmax(1)``
  con = lambda p: jnp.max(jax.nn.softmax(p, -1), -1, keepdims=True)
  if mode == "sum":
    score = p1 + p2
  elif mode == "first":
    score = p1
  elif mode == "second":
    score = p2
  elif mode == "entropy":
    score = jnp.where(ent(p1) >= ent(p2), p2, p1)
  elif mode == "confidence":
    score = jnp.where(con(p1) <= con(p2), p2, p1)
  elif mode == "var":
    score = jnp.where(jnp.var(p1, -1, ddof=1, keepdims=True) <= jnp.var(p2, -1, ddof=1, keepdims=True), p2, p1)
  elif mode == "entropy_sum":
    score = p1 * ent(p2) + p2 * ent(p1)
  elif mode == "confidence_sum":
    score = p1 * con(p1) + p2 * con(p2)
  else:
    raise ValueError(f"ensemble: expected one of {ENSEMBLES}, got {mode!r}")
  score = score / jnp.sum(score, -1, keepdims=True)
  return jnp.log(jnp.maximum(score, jnp.finfo(jnp.float32).tiny))


def to_uint8(x: Array) -> Array:
  """[-1, 1] images as ``torchvision.utils.save_image(normalize=True, range=(-1, 1))`` writes them."""
  return jnp.floor(jnp.clip((jnp.clip(x, -1, 1) + 1) / 2 * 255 + 0.5, 0, 255)).astype(jnp.uint8)


def jpeg_round_trip_host(images: np.ndarray, quality: int) -> np.ndarray:
  """uint8 NHWC images saved as JPEG by PIL at ``quality`` (its other defaults) and read back (host side)."""
  from PIL import Image

  out = np.empty_like(images)
  for i, img in enumerate(np.asarray(images)):
    buf = io.BytesIO()
    gray = img.shape[-1] == 1
    Image.fromarray(img[..., 0] if gray else img).save(buf, format="JPEG", quality=int(quality))
    buf.seek(0)
    back = np.asarray(Image.open(buf).convert("L" if gray else "RGB"))
    out[i] = back[..., None] if gray else back
  return out


def jpeg_round_trip(images: Array, quality: int, codec: str = "pil") -> Array:
  """The JPEG round trip of uint8 NHWC ``images`` inside a jitted program: ``codec`` 'pil'
  `jpeg_round_trip_host` (PIL, the reference, through ``jax.pure_callback``), 'device' the corruption stream's
  jitted libjpeg codec (`corrupt_device.jpeg`: PIL's baseline path, 4:2:0, integer DCT), with no host transfer.
  A one-channel image goes through the latter as three equal channels and keeps the first (PIL would save a
  grayscale JPEG)."""
  if codec == "device":
    from pcsr_jax.data.generators import corrupt_device

    gray = images.shape[-1] == 1
    rgb = jnp.repeat(images, 3, axis=-1) if gray else images
    out = corrupt_device.jpeg(rgb, int(quality))
    return out[..., :1] if gray else out
  shape = jax.ShapeDtypeStruct(images.shape, jnp.uint8)
  return jax.pure_callback(lambda a: jpeg_round_trip_host(a, quality), shape, images, vmap_method="sequential")


JPEG_CODECS = ("auto", "pil", "device")


@dataclasses.dataclass(frozen=True)
class DDA(Method):
  name: ClassVar[str] = "dda"
  cost: ClassVar[str] = "2F + 50 UNet F+B per image"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the ensemble `update` returns: see the docstring

  unet: Optional[str] = field(None)  # a diffusion checkpoint folder (convert_weights.py --unet-config)
  D: int = field(4, ">= 1")  # phi_D's down/up factor, a power of 2 (the official asserts log2(D) is whole)
  N: int = field(50, ">= 1")  # respaced index the input is noised to; N guided steps follow
  scale: float = field(6.0, ">= 0")  # guidance step size
  respacing: str = field("100")  # guided-diffusion's --timestep_respacing ("100", "ddim50", "10,15,20")
  jpeg_quality: int = field(75, "[0, 100]")  # the official save-as-JPEG round trip; 0: off
  # Its codec: 'pil' (the reference, on the host), 'device' (`corrupt_device.jpeg`, jitted), 'auto': PIL on a
  # CPU, the device's on a GPU or TPU (where a host callback would stall the step and keep it from lowering).
  jpeg: str = field("auto", JPEG_CODECS)
  guidance: str = field("batch", diffusion.GUIDANCE)  # 'batch': one norm per group (official); 'image'
  group: int = field(4, ">= 1")  # images per UNet batch and per 'batch' norm (the script's per-GPU batch)
  ensemble: str = field("sum", ENSEMBLES)
  # the classifier checkpoint's normalisation, one value per RGB channel
  mean: tuple[float, ...] = field((0.5, 0.5, 0.5), size=3)
  std: tuple[float, ...] = field((0.5, 0.5, 0.5), "> 0", size=3)

  def __post_init__(self):
    super().__post_init__()
    if self.D & (self.D - 1):
      raise UserError(f"dda D: expected a power of 2 (as the official asserts), got {self.D}")
    try:
      diffusion.check_respacing(self.respacing)
    except UserError as e:
      raise UserError(f"dda {e}") from None

  def _schedule(self, meta: Mapping[str, Any]) -> diffusion.Schedule:
    """The respaced schedule for a checkpoint's settings, with ``N`` checked against its length."""
    steps, schedule_name, _ = diffusion_settings(meta)
    try:
      sched = diffusion.make_schedule(steps, schedule_name, self.respacing)
    except UserError as e:
      raise UserError(f"dda {e} (for {steps} diffusion steps)") from None
    if self.N >= sched.num_timesteps:
      raise UserError(f"dda N: expected below the respaced step count {sched.num_timesteps} "
                      f"(respacing {self.respacing!r}), got {self.N}")
    return sched

  def check_inputs(self, model, params, batch_size):
    """``unet`` names a diffusion checkpoint that loads whole (readable, finite params that match its metadata)
    and fits the classifier (its channels, unconditional, ``D`` within its image size), ``respacing`` and
    ``N``. The harness calls this before any work; `prepare` loads the UNet again (twice the read of its
    weights, against a run that stopped after the other methods' work for a damaged file)."""
    del params, batch_size
    self._load_unet(model)

  def _load_unet(self, model: nn.Module) -> tuple[nn.Module, Any, Mapping[str, Any]]:
    """The UNet module, its params and metadata, checked (`check_inputs`)."""
    from pcsr_jax import checkpoint

    if not self.unet:
      raise UserError(f"dda unet: needs a diffusion checkpoint; {MAKE_ONE}")
    try:
      meta = checkpoint.load_meta(self.unet)
    except UserError as e:
      raise UserError(f"dda unet: {e}") from None
    if meta.get("kind") != "unet":
      raise UserError(f"dda unet {self.unet}: a classifier checkpoint ({meta.get('arch')}), not a diffusion model; "
                      f"{MAKE_ONE}")
    self._schedule(meta)
    try:
      unet, unet_params, meta = checkpoint.load(self.unet)
    except UserError as e:
      raise UserError(f"dda unet: {e}") from None
    self._check_unet(model, unet.config)
    return unet, unet_params, meta

  def _check_unet(self, model: nn.Module, cfg: Any) -> None:
    """The UNet's config (``in_channels``, ``class_cond``, ``image_size``) against the classifier and ``D``."""
    if cfg.in_channels != model.config.in_chans:
      raise UserError(f"dda unet {self.unet}: a {cfg.in_channels}-channel model for a {model.config.in_chans}-channel "
                      f"classifier")
    if getattr(cfg, "class_cond", False):
      raise UserError(f"dda unet {self.unet}: a class-conditional model; DDA projects with an unconditional one "
                      f"(256x256_diffusion_uncond)")
    if cfg.image_size // self.D < 1:
      raise UserError(f"dda D: expected at most the UNet's image size {cfg.image_size}, got {self.D}")

  def prepare(self, model, params, rng, batch_size):
    del rng, batch_size
    unet, unet_params, meta = self._load_unet(model)
    return self.prepare_with(model, params, unet, unet_params, meta)

  def prepare_with(self, model: nn.Module, params: Any, unet: nn.Module, unet_params: Any,
                   meta: Mapping[str, Any]) -> DDAPrepared:
    """`prepare` with the UNet given: ``unet.apply({'params': unet_params}, x, t)`` and its metadata (the
    diffusion settings, `diffusion_settings`). The module's ``config`` gives ``image_size`` and ``in_channels``."""
    _, _, learn_sigma = diffusion_settings(meta)
    cfg = unet.config
    self._check_unet(model, cfg)
    return DDAPrepared(model, params, is_trainable=lambda path: False, tx=optax.identity(),
                       consts={"unet": unet_params}, unet=unet, schedule=self._schedule(meta),
                       learn_sigma=learn_sigma, unet_size=int(cfg.image_size))

  @staticmethod
  def unet_for(prep: DDAPrepared) -> nn.Module:
    """The UNet as it runs on the step's platform: on a CPU its convolutions as matmuls and its GroupNorms from
    per-channel sums with a closed-form backward, the faster on XLA:CPU (`pcsr_jax.models.unet`'s docstring;
    the same values up to float32 summation order); elsewhere XLA's own."""
    unet = prep.unet
    if prep.platform != "cpu":
      return unet
    faster = {k: v for k, v in (("conv", "dots"), ("norm", "sums")) if getattr(unet, k, None) == "xla"}
    return unet.clone(**faster) if faster else unet

  def to_unet(self, prep: DDAPrepared, images: Array) -> Array:
    """Normalized classifier input -> [-1, 1] at the UNet's size."""
    y = augment.denormalize(images, self.mean, self.std) * 2 - 1
    b, h, w, c = y.shape
    if (h, w) != (prep.unet_size, prep.unet_size):
      y = jax.image.resize(y, (b, prep.unet_size, prep.unet_size, c), "cubic")
    return jnp.clip(y, -1, 1)

  def from_unet(self, prep: DDAPrepared, x: Array, size: tuple[int, int]) -> Array:
    """A projection in [-1, 1] at the UNet's size -> normalized classifier input of ``size``, through the
    official's 8-bit JPEG round trip unless ``jpeg_quality`` is 0."""
    if self.jpeg_quality:
      codec = self.jpeg if self.jpeg != "auto" else "pil" if prep.platform == "cpu" else "device"
      x01 = jpeg_round_trip(to_uint8(x), self.jpeg_quality, codec).astype(jnp.float32) / 255
    else:
      x01 = jnp.clip((x + 1) / 2, 0, 1)
    b, h, w, c = x01.shape
    if (h, w) != size:
      x01 = jax.image.resize(x01, (b,) + size + (c,), "cubic")
    return augment.normalize(x01, self.mean, self.std)

  def project(self, prep: DDAPrepared, unet_params: Any, y: Array, rows: Array, key: Array) -> Array:
    """DDA's projection of ``y`` ([-1, 1] NHWC at the UNet's size) in groups of ``group`` images
    (`diffusion.guided_sample` each; ``rows`` False: padding, out of every norm): one after the other on a CPU,
    together on a GPU or TPU (``prep.platform``).

    On a mesh of several devices whose count divides the number of groups, each device runs its own groups
    (``shard_map``), concurrently: the same groups, keys and ops as on one device. Left to the partitioner, the
    loop over groups ran every group on every device (one group's images are one device's rows): on two CPU
    devices about twice the time per group of the per-device groups (`python -m benchmarks.dda_projection`)."""
    b = y.shape[0]
    g = min(self.group, b)
    n = math.ceil(b / g)
    pad = n * g - b
    y = jnp.concatenate([y, jnp.zeros((pad,) + y.shape[1:], y.dtype)]) if pad else y
    rows = jnp.concatenate([rows, jnp.zeros((pad,), bool)]) if pad else rows
    unet = self.unet_for(prep)
    model_fn = lambda x, t: unet.apply({"params": unet_params}, x, t)

    def one(args):
      yg, kg, rg = args
      return diffusion.guided_sample(prep.schedule, model_fn, yg, kg, N=self.N, D=self.D, scale=self.scale,
                                     guidance=self.guidance, learn_sigma=prep.learn_sigma, rows=rg)

    # A CPU runs the groups one after the other (one UNet batch of ``group`` images at a time stays in its
    # caches); a GPU or TPU all at once, one UNet batch of them all: each group's guidance norm is its own
    # either way (`diffusion.guided_sample` of the group's rows).
    each = jax.vmap if prep.platform != "cpu" else (lambda f: lambda xs: jax.lax.map(f, xs))

    def groups(y, keys, rows):  # the groups of these rows
      m = keys.shape[0]
      out = each(one)((y.reshape((m, g) + y.shape[1:]), keys, rows.reshape(m, g)))
      return out.reshape((m * g,) + y.shape[1:])

    devices = 1 if prep.mesh is None else prep.mesh.devices.size
    if devices > 1 and n % devices == 0:
      groups = jax.shard_map(groups, mesh=prep.mesh, in_specs=(P("data"), P("data"), P("data")),
                             out_specs=P("data"))
    return groups(y, jax.random.split(key, n), rows)[:b]

  def update(self, prep, frozen, state, images, valid):
    rng, key = jax.random.split(state.rng)
    logits_in, _ = self.forward(prep, frozen, state.trainable, images)
    generated = self.project(prep, prep.consts["unet"], self.to_unet(prep, images), valid, key)
    generated = self.from_unet(prep, generated, images.shape[1:3])
    logits_gen, _ = self.forward(prep, frozen, state.trainable, generated)
    logits = ensemble(logits_in, logits_gen, self.ensemble)
    agree = losses.masked_mean((logits_in.argmax(-1) == logits_gen.argmax(-1)).astype(jnp.float32), valid)
    metrics = {"entropy": losses.masked_mean(losses.entropy(logits), valid), "agreement": agree}
    return state.replace(step=state.step + 1, rng=rng), logits, metrics
