"""A Vision Transformer in Flax Linen whose parameters map one-to-one onto timm's.

The parameter tree mirrors timm's ``VisionTransformer`` state dict: timm's
``blocks.3.attn.qkv.weight`` is ``params['blocks_3']['attn']['qkv']['kernel']``
(transposed), ``norm1.weight`` is ``norm1/scale``, and so on
(`pcsr_jax.weights.timm_map` holds the exact map). Numerics follow timm: pre-norm
blocks, LayerNorm eps 1e-6, fused qkv with bias, exact (erf) GELU, attention
scale ``head_dim ** -0.5``, and a position embedding whose slot 0 belongs to
the class token (concatenate the class token first, then add). The head reads
token 0.

LayerNorm, GELU and the softmax attention are `pcsr_jax.models.ops`'s: the same forward values
(the attention up to float32 ulps) with hand-written backward passes, for speed on XLA:CPU.

Mixed precision. ``dtype`` (default None: float32 throughout, the paper-number
path) is the compute dtype of the backbone, e.g. ``jnp.bfloat16``: patch
embedding, blocks and their LayerNorm outputs compute in it, while the params
stay float32 (so gradients and optimizer state are float32), LayerNorm
statistics and the attention softmax are computed in float32, and the final
norm, the head and the returned logits and features are float32. The model
config (and so checkpoints and their conversion) does not depend on it.

Attention kernels. ``attention='matmul'`` (the default) is the head-major
batched-matmul softmax attention below. ``'xla'`` and ``'cudnn'`` call
``jax.nn.dot_product_attention`` with that implementation; cuDNN's fused
(flash) attention needs a CUDA GPU and a 16-bit ``dtype`` (an odd token count,
ViT's 197, is padded by one masked token: `fused_attention`), and where it is not
available at trace time the model warns once and falls back to ``'matmul'``.
``'auto'`` (the harness's default) names one per platform, resolved before the model runs by `for_platform`
from the devices the step is built for (`attention_for`: cuDNN for 16-bit on a GPU, XLA's for float32 on a GPU
and on a TPU, ``matmul`` on a CPU); `for_platform` also turns `ops`' CPU-only backward passes off elsewhere.

Scale-shift recalibration. `Attention` takes an optional per-sample
``(gamma, beta)`` and computes ``gamma * X + beta`` for X in {Q, K, V} over all
tokens and all heads before the softmax attention (PCSR, eqs. 6-7). The factors
come from a *recalibrator*: a module built by a `Recalibration` spec, called
with the block input and its norm1 output, one per layer or one shared by all
layers. Without a spec no recalibration op is traced, so the plain model costs
exactly what timm's does.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Protocol, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcsr_jax.errors import UserError
from pcsr_jax.models.configs import ViTConfig
from pcsr_jax.models.ops import LayerNorm, PatchConv, gelu, softmax_attention

Array = jax.Array

LN_EPS = 1e-6  # timm: partial(nn.LayerNorm, eps=1e-6)
ATTENTION_IMPLS = ("auto", "matmul", "xla", "cudnn")
Dtype = Any  # a jnp floating dtype, or None for float32


class Recalibration(Protocol):
  """What the ViT needs from a recalibration method such as PCSR.

  ``make()`` returns a fresh module mapping ``(x, h)`` -- the block input and
  its norm1 output, both ``[B, T, D]`` with the class token at 0 -- to
  ``(gamma, beta)`` of shape ``[B, S, D]``, where S is 1 (factors shared by
  Q, K and V) or 3 (independent factors for Q, K, V in that order).
  ``dtype`` is the backbone's compute dtype (None: float32), for its layers.
  """

  shared_across_layers: bool
  skip_blocks: tuple[int, ...]  # blocks left without a recalibrator

  def make(self, dtype: Dtype = None) -> nn.Module:
    ...


class PatchEmbed(nn.Module):
  """timm ``patch_embed``: a stride-p conv (`ops.PatchConv`, ``nn.Conv`` with a faster backward), flattened
  to ``[B, N, D]``."""

  patch_size: int
  embed_dim: int
  dtype: Dtype = None
  cpu_ops: bool = True  # `ops`' hand-written backward passes (a CPU's)

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = self.patch_size
    x = PatchConv(self.embed_dim, p, dtype=self.dtype, closed_form=self.cpu_ops, name="proj")(x)
    b, h, w, d = x.shape
    return x.reshape(b, h * w, d)


class Attention(nn.Module):
  """timm ``Attention`` with an optional scale-shift on Q, K and V."""

  dim: int
  num_heads: int
  dtype: Dtype = None
  implementation: str = "matmul"  # one of ATTENTION_IMPLS but "auto" (see the module docstring)
  cpu_ops: bool = True

  @nn.compact
  def __call__(self, x: Array, scale_shift: Optional[tuple[Array, Array]] = None, extra_qkv: Optional[Array] = None,
               cls_attention: bool = False):
    """The attention's output ``[B, T, D]``. ``extra_qkv`` ``[B, 3D]``: one more token's q, k and v (DCT's
    generated token), appended after the T tokens and its output row dropped, so only its key and value act.
    ``cls_attention``: also the class token's attention weights over the T tokens, the heads' mean ``[B, T]``."""
    b, t, d = x.shape
    h = self.num_heads
    qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(x).reshape(b, t, 3, h, d // h)  # timm rows: q | k | v
    if extra_qkv is not None:
      if scale_shift is not None:
        raise UserError("attention: a generated q/k/v token and a scale-shift cannot be combined")
      qkv = jnp.concatenate([qkv, extra_qkv.astype(qkv.dtype).reshape(b, 1, 3, h, d // h)], axis=1)
    weights = _cls_weights(qkv[:, :t], d // h) if cls_attention else None
    ss = None
    if scale_shift is not None:
      gamma, beta = scale_shift  # [B, 1 or 3, D]: one factor per channel = per head slice
      if self.dtype is not None:
        gamma, beta = gamma.astype(self.dtype), beta.astype(self.dtype)
      ss = gamma.reshape(b, -1, h, d // h), beta.reshape(b, -1, h, d // h)  # [B, 1 or 3, H, Dh]
    out = self._fused(qkv, ss) if self.implementation != "matmul" else None
    if out is None:
      qkv = qkv.transpose(2, 0, 3, 1, 4)  # [3, B, H, T, Dh], as timm
      # A split, not qkv[0], qkv[1], qkv[2]: the VJP of a split is one concatenate, that of an index pads each
      # gradient to the whole [3, ...] and adds the three, full-size copies that XLA:CPU kept (with the extra
      # transposes of the old scale-shift below, 28% of the non-matmul time of PCSR's step at ViT-S/16 batch 16:
      # `benchmarks/profile_step.py`).
      q, k, v = (a[0] for a in jnp.split(qkv, 3, axis=0))
      if ss is not None:
        # Scale-shift q, k and v in the head-major layout the matmuls read, not [B, T, 3, D] before the
        # transpose: there the backward transposed the gradient twice more (once per consumer).
        n = ss[0].shape[1]
        q, k, v = (ss[0][:, j % n, :, None] * a + ss[1][:, j % n, :, None] for j, a in enumerate((q, k, v)))
      # softmax(q k^T / sqrt(head_dim)) v, as timm (and eq. 7 with d = head dim). Head-major batched
      # matmuls: on XLA:CPU about 1.4x faster than jax.nn.dot_product_attention's [B, T, H, Dh] layout.
      out = softmax_attention(q * (d // h) ** -0.5, k, v, self.cpu_ops).transpose(0, 2, 1, 3)
    out = nn.Dense(d, dtype=self.dtype, name="proj")(out[:, :t].reshape(b, t, d))
    return (out, weights) if cls_attention else out

  def _fused(self, qkv: Array, ss: Optional[tuple[Array, Array]]) -> Optional[Array]:
    """``jax.nn.dot_product_attention`` on ``[B, T, 3, H, Dh]`` (scale-shifted by ``ss``, ``[B, 1 or 3, H, Dh]``
    each), ``[B, T, H, Dh]`` out; None if unavailable."""
    if self.implementation not in ATTENTION_IMPLS:
      raise UserError(f"attention: expected one of {', '.join(ATTENTION_IMPLS)}, got '{self.implementation}'")
    if ss is not None:
      qkv = ss[0][:, None] * qkv + ss[1][:, None]
    q, k, v = (a[:, :, 0] for a in jnp.split(qkv, 3, axis=2))
    # The cuDNN kernel checks backend, dtype and shapes while tracing, the backward pass's conditions too when
    # the call is differentiated. A forward-only pass keeps the unpadded kernel (its speed was measured); an
    # odd length that only the backward refuses is padded (`fused_attention`); any other refusal -> matmul.
    tries = [False] + ([True] if self.implementation == "cudnn" and q.shape[1] % 2 else [])
    for even_length in tries:
      try:
        return fused_attention(q, k, v, self.implementation, even_length=even_length)
      except Exception as e:  # noqa: BLE001 -- a refusal: the next try, then the matmul path
        err = e
    _warn_once(f"attention='{self.implementation}' unavailable here ({type(err).__name__}: "
               f"{str(err).splitlines()[0][:120] if str(err) else ''}); using 'matmul'")
    return None


def _cls_weights(qkv: Array, head_dim: int) -> Array:
  """The class token's softmax attention weights over the tokens of ``qkv`` ``[B, T, 3, H, Dh]``, the mean over
  the heads ``[B, T]`` (float32): timm's ``attn`` row 0, as REM reads the last block's."""
  q, k = qkv[:, 0, 0].astype(jnp.float32), qkv[:, :, 1].astype(jnp.float32)
  scores = jnp.einsum("bhd,bthd->bht", q * head_dim ** -0.5, k)
  return jax.nn.softmax(scores, axis=-1).mean(axis=1)


def fused_attention(q: Array, k: Array, v: Array, implementation: str, even_length: bool = False) -> Array:
  """``jax.nn.dot_product_attention`` of ``[B, T, H, Dh]`` q, k, v with ``implementation``.

  ``even_length``: an odd T gets one zero token appended and masked out of the keys (``key_value_seq_lengths``),
  and the extra query row is dropped, so the result is the unpadded attention's. cuDNN's flash attention needs
  it: jax 0.10-0.11 refuses an odd sequence length for the backward pass (the placeholder it passes for "no
  bias" counts as a bias there), which made every training step with ViT's 197 tokens fall back to the matmul
  attention on an H200 ("Unsupported sequence length Q 197, KV 197").
  """
  t = q.shape[1]
  if not (even_length and t % 2):
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  pad = ((0, 0), (0, 1), (0, 0), (0, 0))
  q, k, v = (jnp.pad(a, pad) for a in (q, k, v))
  lengths = jnp.full((q.shape[0],), t, jnp.int32)
  out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=implementation)
  return out[:, :t]


class Mlp(nn.Module):
  """timm ``Mlp``: fc1 -> exact GELU -> fc2."""

  hidden_dim: int
  dtype: Dtype = None
  cpu_ops: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    d = x.shape[-1]
    x = gelu(nn.Dense(self.hidden_dim, dtype=self.dtype, name="fc1")(x), self.cpu_ops)
    return nn.Dense(d, dtype=self.dtype, name="fc2")(x)


class Block(nn.Module):
  """Pre-norm transformer block; ``recalibrator`` feeds the attention's scale-shift."""

  dim: int
  num_heads: int
  mlp_dim: int
  recalibrator: Optional[nn.Module] = None
  dtype: Dtype = None
  attention: str = "matmul"
  cpu_ops: bool = True
  qkv_generator: Optional[nn.Module] = None  # DCT: the normed class token -> one more token's q, k, v [B, 3D]

  @nn.compact
  def __call__(self, x: Array, return_norm1: bool = False, cls_attention: bool = False):
    """The block's output; with ``return_norm1`` also its norm1 output (``[B, T, D]`` each); with
    ``cls_attention`` also the class token's attention weights (`Attention`)."""
    cf = self.cpu_ops
    h = LayerNorm(epsilon=LN_EPS, dtype=self.dtype, closed_form=cf, name="norm1")(x)  # float32 statistics
    ss = self.recalibrator(x, h) if self.recalibrator is not None else None
    extra = self.qkv_generator(h[:, 0]) if self.qkv_generator is not None else None
    a = Attention(self.dim, self.num_heads, self.dtype, self.attention, cf, name="attn")(h, ss, extra, cls_attention)
    a, weights = a if cls_attention else (a, None)
    x = x + a
    out = x + Mlp(self.mlp_dim, self.dtype, cf, name="mlp")(LayerNorm(epsilon=LN_EPS, dtype=self.dtype,
                                                                         closed_form=cf, name="norm2")(x))
    if cls_attention:
      return out, weights
    return (out, h) if return_norm1 else out


class VisionTransformer(nn.Module):
  """timm ``VisionTransformer`` (class token, no register tokens, no fc_norm).

  Input: float32 NHWC images normalized with the checkpoint's mean and std.
  Output: ``[B, num_classes]`` logits, or ``[B, D]`` features when
  ``num_classes == 0``. With ``return_features=True`` it also returns the token
  features after every block (a tuple of ``[B, T, D]``). With ``pre_logits=True``
  the first output is the head's input instead of the logits: the final-LN class
  token ``[B, D]`` (timm's ``forward_head(pre_logits=True)``), on which T3A builds
  its prototypes.

  Prompts (VPT, as FOA's ``models/vpt.py``): ``prompts`` of shape ``[P, D]``
  are inserted after the class token and before the patch tokens, *after* the
  position embedding is added (they carry no position). They are an input, not
  a param, so ``jax.vmap`` over a stack of prompts evaluates many candidates in
  one program. ``return_cls=True`` returns ``(logits, cls)`` instead, with
  ``cls`` of shape ``[B, depth, D]``: every block's class-token output
  normalised by the *next* block's norm1 and the last one by the final norm
  (FOA's ``_collect_layers_features``); ``cls[:, -1]`` is what the head reads,
  and `classify` applies the head to such a feature.
  """

  config: ViTConfig
  recalibration: Optional[Any] = None  # a `Recalibration` spec, e.g. pcsr.PCSRConfig
  # Restrict the logits to these classes (ImageNet-R/-A: their 200 of the 1000 ImageNet classes).
  class_subset: Optional[tuple[int, ...]] = None
  dtype: Dtype = None  # the backbone's compute dtype (None: float32); params stay float32
  attention: str = "matmul"  # one of ATTENTION_IMPLS; "auto" until `for_platform` resolves it
  cpu_ops: bool = True  # `ops`' hand-written backward passes, for XLA:CPU (`for_platform`)
  qkv_tokens: Optional[Any] = None  # a `QKVTokens` spec, e.g. dct.DCTConfig

  def setup(self):
    c = self.config
    if self.attention not in ATTENTION_IMPLS:
      raise UserError(f"attention: expected one of {', '.join(ATTENTION_IMPLS)}, got '{self.attention}'")
    if self.attention == "auto":
      raise UserError("attention='auto' names a kernel per platform: resolve it with vit.for_platform(model, "
                      "platform) (engine.Adapter does) before applying the model")
    self.patch_embed = PatchEmbed(c.patch_size, c.embed_dim, self.dtype, self.cpu_ops)
    self.cls_token = self.param("cls_token", nn.initializers.normal(1e-6), (1, 1, c.embed_dim))
    self.pos_embed = self.param("pos_embed", nn.initializers.normal(0.02), (1, c.num_patches + 1, c.embed_dim))
    recals: Sequence[Optional[nn.Module]] = [None] * c.depth
    if self.recalibration is not None:
      layers = [i for i in range(c.depth) if i not in self.recalibration.skip_blocks]
      n = 1 if self.recalibration.shared_across_layers else len(layers)
      # Top-level children (``recal_0`` ...: the j-th recalibrated block's), so the backbone tree stays timm's.
      self.recal = [self.recalibration.make(self.dtype) for _ in range(n)]
      for j, i in enumerate(layers):
        recals[i] = self.recal[j % n]
    gens: Sequence[Optional[nn.Module]] = [None] * c.depth
    if self.qkv_tokens is not None:
      # Top-level children (``qkv_gen_0`` ...: the j-th generating block's), as the recalibrators.
      self.qkv_gen = [self.qkv_tokens.make(c.embed_dim, self.dtype) for _ in self.qkv_tokens.blocks]
      for j, i in enumerate(self.qkv_tokens.blocks):
        gens[i] = self.qkv_gen[j]
    self.blocks = [Block(c.embed_dim, c.num_heads, c.mlp_dim, recalibrator=recals[i], dtype=self.dtype,
                         attention=self.attention, cpu_ops=self.cpu_ops, qkv_generator=gens[i])
                   for i in range(c.depth)]
    # float32 with the head: the logits feed entropies and filters
    self.norm = LayerNorm(epsilon=LN_EPS, closed_form=self.cpu_ops)
    if c.num_classes > 0:
      self.head = nn.Dense(c.num_classes)

  def classify(self, feature: Array) -> Array:
    """The head on the normalised class-token feature ``[B, D]`` (restricted to ``class_subset``)."""
    if self.config.num_classes == 0:
      return feature
    logits = self.head(feature)
    if self.class_subset is not None:
      logits = logits[:, jnp.asarray(self.class_subset, jnp.int32)]
    return logits

  def __call__(self, x: Array, return_features: bool = False, prompts: Optional[Array] = None,
               return_cls: bool = False, pre_logits: bool = False, cls_offset: Optional[Array] = None,
               keep: Optional[Array] = None, cls_attention: bool = False):
    x = self.patch_embed(x)
    cls = jnp.broadcast_to(self.cls_token, (x.shape[0], 1, x.shape[-1]))
    if cls_offset is not None:  # VCT: a per-sample token added to the class token, before the position
      cls = cls + cls_offset
    pos = self.pos_embed if self.dtype is None else self.pos_embed.astype(self.dtype)
    x = jnp.concatenate([cls.astype(x.dtype), x], axis=1) + pos
    if keep is not None:  # REM: only these patch tokens [B, K] (indices from 0) go on, after the position
      x = jnp.concatenate([x[:, :1], jnp.take_along_axis(x[:, 1:], keep[..., None], axis=1)], axis=1)
    if prompts is not None:
      prompts = jnp.broadcast_to(prompts.astype(x.dtype), (x.shape[0],) + prompts.shape)
      x = jnp.concatenate([x[:, :1], prompts, x[:, 1:]], axis=1)
    f32 = (lambda a: a) if self.dtype is None else (lambda a: a.astype(jnp.float32))
    feats, cls_feats, weights = [], [], None
    for i, blk in enumerate(self.blocks):
      if cls_attention and i == len(self.blocks) - 1:
        x, weights = blk(x, cls_attention=True)
      elif return_cls:
        out, h = blk(x, return_norm1=True)
        if feats:
          cls_feats.append(f32(h[:, 0]))  # the previous block's class token, normalised by this block's norm1
        x = out
      else:
        x = blk(x)
      feats.append(f32(x))
    x = f32(x)
    x = self.norm(x)[:, 0]
    out = x if pre_logits else self.classify(x)
    if return_cls:
      return out, jnp.stack(cls_feats + [x], axis=1)
    if cls_attention:
      return out, weights
    return (out, tuple(feats)) if return_features else out


def create(config: ViTConfig, recalibration: Optional[Any] = None, dtype: Dtype = None,
           attention: str = "matmul") -> VisionTransformer:
  """The Flax module for ``config``; ``recalibration`` plugs in e.g. PCSR; ``dtype`` and ``attention`` as
  in the module docstring (e.g. ``create(cfg, dtype=jnp.bfloat16, attention='cudnn')`` on a GPU)."""
  return VisionTransformer(config, recalibration, dtype=dtype, attention=attention)


def attention_for(attention: str, platform: str, dtype: Dtype = None) -> str:
  """The kernel ``attention`` names on ``platform`` ("cpu", "gpu" or "tpu": `pcsr_jax.platforms`) for a
  backbone in ``dtype``: "auto" is cuDNN's fused attention on a GPU in a 16-bit dtype, XLA's
  (``jax.nn.dot_product_attention``) on a GPU in float32 and on a TPU, and the head-major ``matmul`` on a CPU
  (1.4x XLA's there); any other name is kept."""
  if attention != "auto":
    return attention
  if platform == "gpu":
    return "cudnn" if dtype is not None and jnp.dtype(dtype).itemsize == 2 else "xla"
  return "xla" if platform == "tpu" else "matmul"


def for_platform(model: nn.Module, platform: str) -> nn.Module:
  """``model`` as it should run on ``platform``: its attention kernel resolved (`attention_for`) and `ops`'
  hand-written backward passes on a CPU only (on a GPU or TPU, XLA's own fusions). Other modules (the UNet)
  are returned as they are."""
  if not isinstance(model, VisionTransformer):
    return model
  return model.clone(attention=attention_for(model.attention, platform, model.dtype), cpu_ops=platform == "cpu")


def features_and_logits(model: VisionTransformer, params: Any, images: Array) -> tuple[Array, Array]:
  """``(feature, logits)`` of one forward: the head's input (the final-norm class token, timm's
  ``forward_head(pre_logits=True)``), on which CFA, AdaContrast and T3A build, and the logits from it."""
  z = model.apply({"params": params}, images, pre_logits=True)
  return z, model.apply({"params": params}, z, method="classify")


def vpt_bound(config: ViTConfig) -> float:
  """VPT's Xavier-uniform bound for prompt tokens, ``sqrt(6 / (C p^2 + D))`` (0.0625 for ViT-B/16): FOA's
  ``models/vpt.py``, DPCore's ``vpt.py`` and DPAL's prompts (its ``val``) draw from ``U(+-bound)``."""
  return math.sqrt(6.0 / (config.in_chans * config.patch_size ** 2 + config.embed_dim))


def vpt_prompts(config: ViTConfig, num_prompts: int, seed: int) -> Array:
  """``[num_prompts, D]`` prompts drawn from ``U(+-vpt_bound)`` with the key of ``seed``."""
  b = vpt_bound(config)
  return jax.random.uniform(jax.random.key(seed), (num_prompts, config.embed_dim), jnp.float32, -b, b)


def compute_dtype(name: str) -> Dtype:
  """The ``dtype`` for a command-line name: None for 'float32' (the default path), else the jnp dtype."""
  names = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
  if name not in names:
    raise UserError(f"--dtype: expected one of {', '.join(names)}, got '{name}'")
  return names[name]


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
  if msg not in _warned:
    _warned.add(msg)
    warnings.warn(msg, stacklevel=3)


def init_params(model: nn.Module, rng: Array, batch_size: int = 1,
                only: Optional[Callable[[str], bool]] = None, method: Optional[Callable] = None) -> dict:
  """Randomly initialized params (for tests and training from scratch).

  ``only`` keeps the top-level params whose name it accepts, with the values the whole init gives them (each
  param's key comes from its path, not from what else is initialised); the rest is never compiled: PCSR's
  fresh recalibrators on a 24-block model compile in a fifth of the whole init's time. ``method`` is the
  function the init traces (the module's ``__call__`` when None): a model whose extra heads ``__call__`` does
  not reach names one that does (`prompted.init_extra`). ``model.config`` gives the input's shape.
  """
  c = model.config
  x = jnp.zeros((batch_size, c.img_size, c.img_size, c.in_chans), jnp.float32)

  def init(key):
    params = model.init(key, x, method=method)["params"]
    return params if only is None else {k: v for k, v in params.items() if only(k)}

  return jax.jit(init)(rng)
