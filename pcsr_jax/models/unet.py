"""guided-diffusion's ``UNetModel`` (``openai/guided-diffusion``: ``unet.py``, ``nn.py``, ``fp16_util.py``) in Flax.

What it computes, top to bottom (NHWC here, NCHW there; the maths is the same):

* the timestep ``t`` (the original integer step, 0..T-1) -> sinusoidal embedding of ``num_channels`` values,
  cos then sin, frequencies ``exp(-log(10000) * i / half)`` -> ``time_embed``: Linear(C, 4C), SiLU,
  Linear(4C, 4C); plus ``label_emb`` (1000 classes) when class-conditional;
* ``input_blocks``: a 3x3 conv, then per level ``num_res_blocks`` ResBlocks (each followed by an
  AttentionBlock at the attention resolutions) and, except at the last level, a downsampling block: a ResBlock
  with ``down`` (``resblock_updown``) or a stride-2 3x3 conv; every input block's output is kept for a skip;
* ``middle_block``: ResBlock, AttentionBlock, ResBlock;
* ``output_blocks``: per level from the deepest, ``num_res_blocks + 1`` blocks, each the concatenation of the
  running features and the last kept skip, a ResBlock, an AttentionBlock at the attention resolutions, and at
  the level's last block (except at the top level) an upsampling block (a ResBlock with ``up``, or nearest x2
  then a 3x3 conv);
* ``out``: GroupNorm32, SiLU, 3x3 conv to ``out_channels`` (eps first, then the variance value when
  ``learn_sigma``).

ResBlock: ``in_layers`` (GroupNorm32, SiLU, 3x3 conv), the embedding through SiLU and a Linear (to 2C with
``use_scale_shift_norm``, applied as ``GN(h) * (1 + scale) + shift``, else to C and added before the
``out_layers``), ``out_layers`` (GroupNorm32, SiLU, dropout, 3x3 conv), and a skip that is the identity or a 1x1
conv. The up/down variants apply nearest x2 / 2x2 average pooling to ``h`` after the first GroupNorm and SiLU
(before the first conv) and to the skip input ``x``, as the official does. AttentionBlock: GroupNorm32, a 1x1
conv C -> 3C, QKV attention (``QKVAttentionLegacy``: the channels are split into heads first, each head's
``3 * ch`` channels being ``[q | k | v]``; with ``use_new_attention_order`` into ``[q | k | v]`` first, then
heads), q and k each scaled by ``ch ** -0.25``, the softmax in float32, a 1x1 ``proj_out``, residual.
GroupNorm32 is torch's ``GroupNorm(32, C)`` (eps 1e-5), computed in float32.

Params mirror the torch state dict: torch's ``input_blocks.3.0.in_layers.2.weight`` is
``params['input_blocks_3_0']['in_layers_2']['kernel']`` (module indices joined by ``_``), so
`pcsr_jax.weights.guided_diffusion` converts by a name rule and a transpose per kind of layer.

Gradient checkpointing (memory only: it changes no value): the official always checkpoints the attention
blocks, and the ResBlocks when ``use_checkpoint``; here `nn.remat` does the same.

Mixed precision. ``dtype='bfloat16'`` is the counterpart of the official ``use_fp16`` with bfloat16 in place
of float16: the convolutions and attention matmuls of the input, middle and output blocks compute in bfloat16
(the params stay float32 and are cast where used), GroupNorm32 computes in float32 and returns bfloat16, the
time embedding and its MLP, the ResBlocks' embedding Linear and the final ``out`` layers are float32, as
``fp16_util.convert_module_to_f16`` converts only the torso's convolutions.

Convolutions (``conv``, a module field; params and values the same either way up to float32 summation order):
'xla' (the default) is XLA's convolution; 'dots' builds each 3x3 conv as one matmul over the 9 shifted copies of
the padded input (im2col), the 1x1 ones as a matmul. DDA takes 'dots' on a CPU backend (`DDA.prepare_with`):
there XLA's convolutions inside the sampler's ``fori_loop`` ran at well under half the speed of the same step
called from Python, and the matmuls do not slow down in the loop (`python -m benchmarks.dda_projection`).

GroupNorms (``norm``, a module field; params and values the same either way up to float32 summation order):
'xla' (the default) reshapes to ``[..., 32, C/32]`` and reduces over the positions and the group's channels
at once, differentiated by XLA; 'sums' (`group_norm`) sums each channel over the positions first (a reduction
along contiguous channels), then the 32 groups' channel sums, and has the closed-form backward (torch's
``native_group_norm_backward``). DDA takes 'sums' on a CPU backend, where XLA reduces the grouped form across
strided channels, forward and backward: with 'sums' the guided step of the benchmarks' UNet runs 126 against
168 ms per group of 4 images on one device, 94 against 120 on two (`python -m benchmarks.dda_projection`).
The defaults stay 'xla' for GPUs and for ``train_ddpm``, whose built-in checkpoint (``assets/fmnist_ddpm``) a
rerun remakes bit for bit.

Departures: ``conv_resample`` is always on and ``dims`` is always 2 (as ``script_util.create_model`` builds
every published model); dropout applies only when called with ``train=True`` (the official's ``model.eval()``
is ``train=False``, the default).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcsr_jax.errors import UserError, check_fields
from pcsr_jax.models.ops import CLOSED_FORM_SCOPE

Array = jax.Array

GROUPS = 32  # nn.py's normalization(): GroupNorm32(32, channels)
GN_EPS = 1e-5  # torch.nn.GroupNorm's default
NUM_CLASSES = 1000  # script_util.NUM_CLASSES: the class-conditional models' label embedding
DTYPES = ("float32", "bfloat16")
CONV_IMPLS = ("xla", "dots")  # `Conv`'s implementations (the module docstring)
NORM_IMPLS = ("xla", "sums")  # `GroupNorm32`'s implementations (the module docstring)

# script_util.create_model's channel multipliers when channel_mult is "".
DEFAULT_CHANNEL_MULT = {512: (0.5, 1, 1, 2, 2, 4, 4), 256: (1, 1, 2, 2, 4, 4), 128: (1, 1, 2, 3, 4),
                        64: (1, 2, 3, 4)}


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  """The model keys of guided-diffusion's ``model_and_diffusion_defaults()`` (same names and meanings), plus
  ``in_channels`` / ``out_channels`` (``create_model`` fixes them at 3 and 3 or 6 by ``learn_sigma``) and the
  compute ``dtype``.

  ``attention_resolutions`` are resolutions in pixels, as the flag is written ("32,16,8" -> (32, 16, 8));
  an empty ``channel_mult`` takes guided-diffusion's default for ``image_size``. Invalid combinations (widths
  GroupNorm32 cannot split, heads that do not divide a width, an image size the levels cannot halve) raise a
  `UserError` naming the field.
  """

  image_size: int
  in_channels: int = 3
  num_channels: int = 128
  out_channels: int = 3
  num_res_blocks: int = 2
  attention_resolutions: tuple[int, ...] = (16, 8)
  channel_mult: tuple[float, ...] = ()
  num_heads: int = 4
  num_head_channels: int = -1
  num_heads_upsample: int = -1
  use_scale_shift_norm: bool = True
  resblock_updown: bool = False
  use_new_attention_order: bool = False
  class_cond: bool = False
  dropout: float = 0.0
  use_checkpoint: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("attention_resolutions", tuple(int(r) for r in self.attention_resolutions))
    mult = tuple(self.channel_mult)
    if not mult:
      if self.image_size not in DEFAULT_CHANNEL_MULT:
        raise UserError(f"channel_mult: no default for image_size {self.image_size} (guided-diffusion has one for "
                        f"{sorted(DEFAULT_CHANNEL_MULT)}); give channel_mult")
      mult = DEFAULT_CHANNEL_MULT[self.image_size]
    set_("channel_mult", tuple(int(m) if float(m).is_integer() else float(m) for m in mult))
    self._validate()

  def _validate(self) -> None:
    if self.dtype not in DTYPES:
      raise UserError(f"dtype: expected one of {list(DTYPES)}, got {self.dtype!r}")
    for k in ("image_size", "in_channels", "num_channels", "out_channels", "num_res_blocks"):
      if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
        raise UserError(f"{k}: expected a positive integer, got {getattr(self, k)!r}")
    for w in self.widths:
      if w < GROUPS or w % GROUPS:
        raise UserError(f"channel_mult {list(self.channel_mult)} x num_channels {self.num_channels}: width {w} is "
                        f"not a multiple of {GROUPS} (GroupNorm32 splits every width into {GROUPS} groups)")
    levels = len(self.channel_mult)
    if self.image_size % 2 ** (levels - 1):
      raise UserError(f"image_size {self.image_size}: {levels} levels (channel_mult) halve it {levels - 1} times")
    if not 0.0 <= self.dropout < 1.0:
      raise UserError(f"dropout: expected a value in [0, 1), got {self.dropout}")
    for heads_key in ("num_heads", "num_heads_upsample"):
      for w in self.attention_widths:
        heads = self.heads(w, upsample=heads_key == "num_heads_upsample")
        if self.num_head_channels != -1 and (self.num_head_channels < 1 or w % self.num_head_channels):
          raise UserError(f"num_head_channels {self.num_head_channels}: does not divide attention width {w}")
        if heads < 1 or w % heads:
          raise UserError(f"{heads_key} {heads}: does not divide attention width {w}")

  @property
  def widths(self) -> tuple[int, ...]:
    """Channels per level, ``int(mult * num_channels)`` as the official computes them."""
    return tuple(int(m * self.num_channels) for m in self.channel_mult)

  @property
  def attention_ds(self) -> tuple[int, ...]:
    """The downsampling rates with attention: ``image_size // r`` per resolution, as ``create_model`` does."""
    return tuple(self.image_size // r for r in self.attention_resolutions if r > 0)

  @property
  def attention_widths(self) -> tuple[int, ...]:
    """Widths of the attention blocks (the levels with attention, and the middle block)."""
    ws = [w for level, w in enumerate(self.widths) if 2 ** level in self.attention_ds]
    return tuple(sorted(set(ws + [self.widths[-1]])))

  def heads(self, width: int, upsample: bool = False) -> int:
    """Heads of an attention block of ``width`` channels: ``width // num_head_channels`` when that is set, else
    ``num_heads`` (``num_heads_upsample`` in the output blocks, where -1 means ``num_heads``)."""
    if self.num_head_channels != -1:
      return width // self.num_head_channels
    if upsample and self.num_heads_upsample != -1:
      return self.num_heads_upsample
    return self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["attention_resolutions"], d["channel_mult"] = list(self.attention_resolutions), list(self.channel_mult)
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "UNetConfig":
    check_fields(cls, d, "UNet config", "unexpected keys")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class Layer:
  """One module of a block: ``kind`` is 'conv' (the stem), 'res', 'attn', 'down' (stride-2 conv) or 'up'
  (nearest x2 + conv); ``out`` its output channels; ``updown`` 'up' / 'down' for a resampling ResBlock;
  ``heads`` for 'attn'."""

  kind: str
  out: int
  updown: str = ""
  heads: int = 0


@dataclasses.dataclass(frozen=True)
class Block:
  """One ``TimestepEmbedSequential``: its layers and the resolution (px) its input has."""

  px: int
  layers: tuple[Layer, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
  input_blocks: tuple[Block, ...]
  middle_block: Block
  output_blocks: tuple[Block, ...]


def plan(cfg: UNetConfig) -> Plan:
  """The block structure ``UNetModel.__init__`` builds for ``cfg``, shared by the model and the converter's
  checks."""
  ds, ch = 1, cfg.widths[0]
  inputs = [Block(cfg.image_size, (Layer("conv", ch),))]
  for level, width in enumerate(cfg.widths):
    for _ in range(cfg.num_res_blocks):
      layers = [Layer("res", width)]
      if ds in cfg.attention_ds:
        layers.append(Layer("attn", width, heads=cfg.heads(width)))
      inputs.append(Block(cfg.image_size // ds, tuple(layers)))
      ch = width
    if level != len(cfg.widths) - 1:
      down = Layer("res", ch, updown="down") if cfg.resblock_updown else Layer("down", ch)
      inputs.append(Block(cfg.image_size // ds, (down,)))
      ds *= 2
  middle = Block(cfg.image_size // ds, (Layer("res", ch), Layer("attn", ch, heads=cfg.heads(ch)), Layer("res", ch)))
  outputs = []
  for level, width in list(enumerate(cfg.widths))[::-1]:
    for i in range(cfg.num_res_blocks + 1):
      layers = [Layer("res", width)]
      if ds in cfg.attention_ds:
        layers.append(Layer("attn", width, heads=cfg.heads(width, upsample=True)))
      px = cfg.image_size // ds
      if level and i == cfg.num_res_blocks:
        layers.append(Layer("res", width, updown="up") if cfg.resblock_updown else Layer("up", width))
        ds //= 2
      outputs.append(Block(px, tuple(layers)))
  return Plan(tuple(inputs), middle, tuple(outputs))


def timestep_embedding(t: Array, dim: int, max_period: float = 10000.0) -> Array:
  """``nn.timestep_embedding``: ``[cos(t f), sin(t f)]`` with ``f_i = exp(-log(max_period) * i / half)``, float32,
  a zero column appended for an odd ``dim``."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = jnp.asarray(t, jnp.float32)[:, None] * freqs[None]
  emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
  if dim % 2:
    emb = jnp.concatenate([emb, jnp.zeros_like(emb[:, :1])], axis=-1)
  return emb


def _group_mean_of(x: Array) -> Callable[[Array], Array]:
  """The function ``v -> each channel's group mean of v`` for arrays shaped as channels-last ``x``: ``v`` summed
  over the positions first (a reduction along contiguous channels), then over each of the `GROUPS` groups'
  channels, divided by the group's element count and broadcast back, shaped ``[N, 1, ..., 1, C]`` to broadcast
  against ``x`` (shared by the forward and the closed-form backward)."""
  n, c = x.shape[0], x.shape[-1]
  count = math.prod(x.shape[1:-1]) * (c // GROUPS)
  positions = tuple(range(1, x.ndim - 1))
  shape = (n,) + (1,) * (x.ndim - 2) + (c,)

  def mean(v: Array) -> Array:
    sums = v.sum(positions).reshape(n, GROUPS, c // GROUPS)
    m = sums.sum(-1, keepdims=True) / count
    return jnp.broadcast_to(m, (n, GROUPS, c // GROUPS)).reshape(shape)

  return mean


def _gn_stats(x: Array) -> tuple[Array, Array]:
  """Each channel's group mean and ``rsqrt(var + eps)``, broadcastable against ``x``."""
  mean = _group_mean_of(x)
  mu = mean(x)
  var = mean(jnp.square(x - mu))  # two passes, as the 'xla' form
  return mu, jax.lax.rsqrt(var + GN_EPS)


@jax.custom_vjp
def group_norm(x: Array, scale: Array, bias: Array) -> Array:
  """`GroupNorm32`'s 'sums' form on float32 channels-last ``x``: ``(x - mean) * (rsqrt(var + eps) * scale) +
  bias``, each group's statistics summed per channel over the positions first (a reduction along contiguous
  channels), then over the group's channels; the backward is the closed form (torch's
  ``native_group_norm_backward``)."""
  return _gn_fwd(x, scale, bias)[0]


def _gn_fwd(x, scale, bias):
  mu, r = _gn_stats(x)
  return (x - mu) * (r * scale) + bias, (x, mu, r, scale)


def _gn_bwd(res, dy):
  # With xhat = (x - mean) * r and g = dy * scale, per group:
  #   dx = r * (g - mean(g) - xhat * mean(g * xhat)),  dscale = sum(dy * xhat),  dbias = sum(dy)
  x, mu, r, scale = res
  mean = _group_mean_of(x)
  xhat = (x - mu) * r
  g = dy * scale
  dx = r * (g - mean(g) - xhat * mean(g * xhat))
  rows = tuple(range(x.ndim - 1))
  return dx, _replicated_grad((dy * xhat).sum(rows), scale), _replicated_grad(dy.sum(rows), scale)


def _varying_axes(x: Array) -> frozenset:
  """The ``shard_map`` mesh axes along which ``x`` varies (none outside ``shard_map``)."""
  t = jax.typeof(x)
  m = getattr(t, "manual_axis_type", None)  # JAX 0.10; earlier releases call it ``vma``
  return frozenset(m.varying) if m is not None else frozenset(getattr(t, "vma", ()))


def _replicated_grad(grad: Array, param: Array) -> Array:
  """Inside ``shard_map``, the gradient of a param replicated over devices is the sum of every device's (what
  autodiff inserts; a custom VJP must do it itself): ``grad`` summed over the axes it varies along and
  ``param`` does not. Unused (DDA differentiates the input only), XLA drops it."""
  axes = tuple(sorted(_varying_axes(grad) - _varying_axes(param)))
  return jax.lax.psum(grad, axes) if axes else grad


group_norm.defvjp(_gn_fwd, _gn_bwd)


class GroupNorm32(nn.Module):
  """torch's ``GroupNorm(32, C)`` (eps 1e-5, biased variance over each group's channels and positions), computed
  in float32 and returned in the input's dtype, as ``nn.GroupNorm32`` does. Channels last, any number of
  positional axes. ``impl`` (`NORM_IMPLS`; the module docstring): 'xla' the grouped reshape and autodiff,
  'sums' `group_norm`."""

  impl: str = "xla"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    if self.impl not in NORM_IMPLS:
      raise UserError(f"norm: expected one of {', '.join(NORM_IMPLS)}, got {self.impl!r}")
    if self.impl == "sums":  # a CPU's form: under the scope a lowered program is checked for
      with jax.named_scope(CLOSED_FORM_SCOPE):
        return group_norm(x.astype(jnp.float32), scale, bias).astype(x.dtype)
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], GROUPS, c // GROUPS)
    axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
    mean = g.mean(axes, keepdims=True)
    var = jnp.square(g - mean).mean(axes, keepdims=True)
    y = ((g - mean) * jax.lax.rsqrt(var + GN_EPS)).reshape(x.shape)
    return (y * scale + bias).astype(x.dtype)


class Conv(nn.Module):
  """A square ``kernel`` x ``kernel`` convolution, stride ``stride``, zero padding ``kernel // 2`` (torch's
  ``conv_nd(2, ..., padding=1)`` for 3x3, none for 1x1), NHWC: ``nn.Conv``'s params (``kernel`` ``[k, k, in,
  out]``, lecun-normal init; ``bias`` zeros) computed by ``impl`` (`CONV_IMPLS`; see the module docstring).
  Inputs and weights are cast to ``dtype``, as ``nn.Conv(dtype=...)`` does."""

  features: int
  kernel: int = 3
  stride: int = 1
  dtype: Any = jnp.float32
  impl: str = "xla"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    k, s, pad = self.kernel, self.stride, self.kernel // 2
    w = self.param("kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features), jnp.float32)
    b = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
    x, w, b = x.astype(self.dtype), w.astype(self.dtype), b.astype(self.dtype)
    if self.impl not in CONV_IMPLS:
      raise UserError(f"conv: expected one of {', '.join(CONV_IMPLS)}, got {self.impl!r}")
    if self.impl == "xla":
      y = jax.lax.conv_general_dilated(x, w, (s, s), ((pad, pad), (pad, pad)),
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
      return y + b
    with jax.named_scope(CLOSED_FORM_SCOPE):  # 'dots', a CPU's form
      n, h, wd, c = x.shape
      ho, wo = (h + 2 * pad - k) // s + 1, (wd + 2 * pad - k) // s + 1
      xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
      # im2col: the k*k shifted (strided) windows side by side on the channel axis, in the kernel's (dy, dx, c)
      # order.
      cols = [xp[:, dy:dy + (ho - 1) * s + 1:s, dx:dx + (wo - 1) * s + 1:s, :]
              for dy in range(k) for dx in range(k)]
      patches = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)
      return patches @ w.reshape(k * k * c, self.features) + b


def _conv(features: int, dtype: Any, name: str, conv: str, kernel: int = 3, stride: int = 1) -> Conv:
  return Conv(features, kernel, stride, dtype, conv, name=name)


def upsample_nearest(x: Array) -> Array:
  """``F.interpolate(x, scale_factor=2, mode='nearest')`` on NHWC."""
  return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def avg_pool2(x: Array) -> Array:
  """``AvgPool2d(kernel_size=2, stride=2)`` on NHWC (even sizes, as every level of the UNet has)."""
  b, h, w, c = x.shape
  return x.reshape(b, h // 2, 2, w // 2, 2, c).mean((2, 4)).astype(x.dtype)


class ResBlock(nn.Module):
  """``unet.ResBlock`` (see the module docstring); ``updown`` is '', 'up' or 'down'."""

  out_channels: int
  use_scale_shift_norm: bool
  updown: str = ""
  dropout: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  conv: str = "xla"  # `Conv`'s impl
  norm: str = "xla"  # `GroupNorm32`'s impl

  @nn.compact
  def __call__(self, x: Array, emb: Array) -> Array:
    resample = {"": lambda a: a, "up": upsample_nearest, "down": avg_pool2}[self.updown]
    h = nn.silu(GroupNorm32(self.norm, name="in_layers_0")(x))
    h, x = resample(h), resample(x)
    h = _conv(self.out_channels, self.dtype, "in_layers_2", self.conv)(h)
    # The embedding Linear stays float32 (fp16_util converts convolutions only); its output takes h's dtype.
    width = 2 * self.out_channels if self.use_scale_shift_norm else self.out_channels
    e = nn.Dense(width, dtype=jnp.float32, param_dtype=jnp.float32, name="emb_layers_1")(nn.silu(emb))
    e = e.astype(h.dtype)[:, None, None, :]
    if self.use_scale_shift_norm:
      scale, shift = jnp.split(e, 2, axis=-1)
      h = GroupNorm32(self.norm, name="out_layers_0")(h) * (1 + scale) + shift
    else:
      h = GroupNorm32(self.norm, name="out_layers_0")(h + e)
    h = nn.Dropout(self.dropout, deterministic=self.deterministic)(nn.silu(h))
    h = _conv(self.out_channels, self.dtype, "out_layers_3", self.conv)(h)
    if x.shape[-1] != self.out_channels:
      x = _conv(self.out_channels, self.dtype, "skip_connection", self.conv, kernel=1)(x)
    return x + h


def qkv_attention(qkv: Array, heads: int, legacy: bool = True) -> Array:
  """``QKVAttentionLegacy`` (``legacy``) or ``QKVAttention`` on channels-last ``qkv`` ``[B, T, 3C]`` ->
  ``[B, T, C]``: legacy reads the channels as ``[head][q|k|v][ch]``, the new order as ``[q|k|v][head][ch]``;
  the output's channels are ``[head][ch]`` either way. q and k are each scaled by ``ch ** -0.25`` before the
  product ("more stable with f16"), the softmax is computed in float32."""
  b, t, width = qkv.shape
  ch = width // (3 * heads)
  parts = qkv.reshape(b, t, heads, 3, ch) if legacy else qkv.reshape(b, t, 3, heads, ch).swapaxes(2, 3)
  q, k, v = parts[..., 0, :], parts[..., 1, :], parts[..., 2, :]
  scale = 1 / math.sqrt(math.sqrt(ch))
  w = jnp.einsum("bthc,bshc->bhts", q * scale, k * scale)
  w = jax.nn.softmax(w.astype(jnp.float32), axis=-1).astype(w.dtype)
  return jnp.einsum("bhts,bshc->bthc", w, v).reshape(b, t, heads * ch)


class AttentionBlock(nn.Module):
  """``unet.AttentionBlock``: GroupNorm32, the qkv 1x1 conv (a Dense on the channels), QKV attention,
  ``proj_out``, residual."""

  heads: int
  use_new_attention_order: bool = False
  dtype: Any = jnp.float32
  norm: str = "xla"  # `GroupNorm32`'s impl

  @nn.compact
  def __call__(self, x: Array) -> Array:
    b, hh, ww, c = x.shape
    flat = x.reshape(b, hh * ww, c)
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=jnp.float32, name=name)
    qkv = dense(3 * c, "qkv")(GroupNorm32(self.norm, name="norm")(flat))
    h = qkv_attention(qkv, self.heads, legacy=not self.use_new_attention_order)
    return (flat + dense(c, "proj_out")(h)).reshape(x.shape)


class Downsample(nn.Module):
  """``unet.Downsample`` with ``use_conv``: a stride-2 3x3 conv, padding 1."""

  out_channels: int
  dtype: Any = jnp.float32
  conv: str = "xla"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return _conv(self.out_channels, self.dtype, "op", self.conv, stride=2)(x)


class Upsample(nn.Module):
  """``unet.Upsample`` with ``use_conv``: nearest x2, then a 3x3 conv."""

  out_channels: int
  dtype: Any = jnp.float32
  conv: str = "xla"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return _conv(self.out_channels, self.dtype, "conv", self.conv)(upsample_nearest(x))


class UNet(nn.Module):
  """guided-diffusion's ``UNetModel`` for ``config``.

  ``apply({'params': p}, x, t, y=None, train=False)``: ``x`` NHWC ``[B, S, S, in_channels]`` (images in about
  [-1, 1]), ``t`` the integer timesteps ``[B]`` (the original 0..T-1, not respaced), ``y`` the class labels
  ``[B]`` of a class-conditional model; returns float32 ``[B, S, S, out_channels]``. ``train=True`` applies
  dropout (needs a 'dropout' rng).
  """

  config: UNetConfig
  conv: str = "xla"  # `Conv`'s impl: 'xla' or 'dots' (the module docstring)
  norm: str = "xla"  # `GroupNorm32`'s impl: 'xla' or 'sums' (the module docstring)

  @nn.compact
  def __call__(self, x: Array, t: Array, y: Optional[Array] = None, train: bool = False) -> Array:
    cfg = self.config
    if cfg.class_cond != (y is not None):
      raise UserError(f"UNet: class_cond is {cfg.class_cond}: pass class labels y if and only if it is true")
    dt = cfg.compute_dtype
    dense = lambda n, name: nn.Dense(n, dtype=jnp.float32, param_dtype=jnp.float32, name=name)
    emb = timestep_embedding(t, cfg.num_channels)
    emb = dense(4 * cfg.num_channels, "time_embed_2")(nn.silu(dense(4 * cfg.num_channels, "time_embed_0")(emb)))
    if cfg.class_cond:
      emb = emb + nn.Embed(NUM_CLASSES, 4 * cfg.num_channels, param_dtype=jnp.float32, name="label_emb")(y)

    res_cls = nn.remat(ResBlock) if cfg.use_checkpoint else ResBlock
    attn_cls = nn.remat(AttentionBlock)  # the official checkpoints every attention block

    def run(block: Block, h: Array, name: str) -> Array:
      for j, layer in enumerate(block.layers):
        lname = f"{name}_{j}"
        if layer.kind == "conv":
          h = _conv(layer.out, dt, lname, self.conv)(h)
        elif layer.kind == "res":
          h = res_cls(layer.out, cfg.use_scale_shift_norm, layer.updown, cfg.dropout, not train, dt, self.conv,
                      self.norm, name=lname)(h, emb)
        elif layer.kind == "attn":
          h = attn_cls(layer.heads, cfg.use_new_attention_order, dt, self.norm, name=lname)(h)
        elif layer.kind == "down":
          h = Downsample(layer.out, dt, self.conv, name=lname)(h)
        else:
          h = Upsample(layer.out, dt, self.conv, name=lname)(h)
      return h

    p = plan(cfg)
    h, hs = x.astype(dt), []
    for i, block in enumerate(p.input_blocks):
      h = run(block, h, f"input_blocks_{i}")
      hs.append(h)
    h = run(p.middle_block, h, "middle_block")
    for i, block in enumerate(p.output_blocks):
      h = run(block, jnp.concatenate([h, hs.pop()], axis=-1), f"output_blocks_{i}")
    h = nn.silu(GroupNorm32(self.norm, name="out_0")(h.astype(jnp.float32)))
    return _conv(cfg.out_channels, jnp.float32, "out_2", self.conv)(h)


def example_inputs(cfg: UNetConfig, batch: int = 1) -> tuple[Any, ...]:
  """Shape-only ``(x, t[, y])`` for `jax.eval_shape` of ``UNet(cfg).init``."""
  x = jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, cfg.in_channels), jnp.float32)
  t = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return (x, t, t) if cfg.class_cond else (x, t)


def param_shapes(cfg: UNetConfig) -> dict:
  """The params tree of ``UNet(cfg)`` as `jax.ShapeDtypeStruct` leaves (no compute)."""
  return jax.eval_shape(UNet(cfg).init, jax.random.key(0), *example_inputs(cfg))["params"]

