"""guided-diffusion's ``UNetModel`` in PyTorch, written from ``openai/guided-diffusion``'s ``unet.py`` and ``nn.py``:
the reference `pcsr_jax.models.unet` is checked against, and the model DDA's PyTorch reference runs.

The module tree and so the state-dict names are the official's (``time_embed.0.weight``,
``input_blocks.1.0.in_layers.2.weight``, ``middle_block.1.qkv.weight``, ``out.2.weight``, ...), so an official
checkpoint loads with ``load_state_dict(sd, strict=True)``. Only what the published models use is here: 2-D,
``conv_resample`` on, ``use_conv=False`` skips. Departures, none of which changes a value: no gradient
checkpointing (the official recomputes the attention blocks, and the ResBlocks with ``use_checkpoint``, in the
backward), and no fp16 conversion (``use_fp16``): the reference runs in float32.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from pcsr_jax.models.unet import NUM_CLASSES, UNetConfig


class GroupNorm32(nn.GroupNorm):
  """GroupNorm computed in float32, returned in the input's dtype."""

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return super().forward(x.float()).type(x.dtype)


def normalization(channels: int) -> nn.Module:
  return GroupNorm32(32, channels)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
  """Sinusoidal embedding: cos then sin of ``t * exp(-log(max_period) * i / half)``."""
  half = dim // 2
  freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half).to(t.device)
  args = t[:, None].float() * freqs[None]
  emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
  if dim % 2:
    emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
  return emb


class TimestepBlock(nn.Module):
  """A module whose forward takes the timestep embedding as a second argument."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):

  def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    for layer in self:
      x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
    return x


class Upsample(nn.Module):
  """Nearest x2, then (``use_conv``) a 3x3 conv."""

  def __init__(self, channels: int, use_conv: bool, out_channels: Optional[int] = None):
    super().__init__()
    self.use_conv = use_conv
    if use_conv:
      self.conv = nn.Conv2d(channels, out_channels or channels, 3, padding=1)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = F.interpolate(x, scale_factor=2, mode="nearest")
    return self.conv(x) if self.use_conv else x


class Downsample(nn.Module):
  """A stride-2 3x3 conv (``use_conv``) or 2x2 average pooling."""

  def __init__(self, channels: int, use_conv: bool, out_channels: Optional[int] = None):
    super().__init__()
    self.op = (nn.Conv2d(channels, out_channels or channels, 3, stride=2, padding=1) if use_conv
               else nn.AvgPool2d(kernel_size=2, stride=2))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.op(x)


def zero_module(m: nn.Module) -> nn.Module:
  for p in m.parameters():
    p.detach().zero_()
  return m


class ResBlock(TimestepBlock):
  """GN-SiLU-conv, the embedding (scale-shift or added), GN-SiLU-dropout-zeroed conv, plus the skip; ``up`` /
  ``down`` resample h between the first SiLU and conv, and the skip input."""

  def __init__(self, channels: int, emb_channels: int, dropout: float, out_channels: Optional[int] = None,
               use_scale_shift_norm: bool = False, up: bool = False, down: bool = False):
    super().__init__()
    self.out_channels = out_channels or channels
    self.use_scale_shift_norm = use_scale_shift_norm
    self.in_layers = nn.Sequential(normalization(channels), nn.SiLU(),
                                   nn.Conv2d(channels, self.out_channels, 3, padding=1))
    self.updown = up or down
    if up:
      self.h_upd, self.x_upd = Upsample(channels, False), Upsample(channels, False)
    elif down:
      self.h_upd, self.x_upd = Downsample(channels, False), Downsample(channels, False)
    else:
      self.h_upd = self.x_upd = nn.Identity()
    self.emb_layers = nn.Sequential(
        nn.SiLU(), nn.Linear(emb_channels, 2 * self.out_channels if use_scale_shift_norm else self.out_channels))
    self.out_layers = nn.Sequential(normalization(self.out_channels), nn.SiLU(), nn.Dropout(p=dropout),
                                    zero_module(nn.Conv2d(self.out_channels, self.out_channels, 3, padding=1)))
    self.skip_connection = (nn.Identity() if self.out_channels == channels
                            else nn.Conv2d(channels, self.out_channels, 1))

  def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    if self.updown:
      h = self.in_layers[:-1](x)
      h, x = self.h_upd(h), self.x_upd(x)
      h = self.in_layers[-1](h)
    else:
      h = self.in_layers(x)
    e = self.emb_layers(emb).type(h.dtype)[..., None, None]
    if self.use_scale_shift_norm:
      scale, shift = torch.chunk(e, 2, dim=1)
      h = self.out_layers[0](h) * (1 + scale) + shift
      h = self.out_layers[1:](h)
    else:
      h = self.out_layers(h + e)
    return self.skip_connection(x) + h


class QKVAttentionLegacy(nn.Module):
  """Heads first, each head's channels ``[q | k | v]``."""

  def __init__(self, n_heads: int):
    super().__init__()
    self.n_heads = n_heads

  def forward(self, qkv: torch.Tensor) -> torch.Tensor:
    bs, width, length = qkv.shape
    ch = width // (3 * self.n_heads)
    q, k, v = qkv.reshape(bs * self.n_heads, ch * 3, length).split(ch, dim=1)
    scale = 1 / math.sqrt(math.sqrt(ch))
    w = torch.einsum("bct,bcs->bts", q * scale, k * scale)
    w = torch.softmax(w.float(), dim=-1).type(w.dtype)
    return torch.einsum("bts,bcs->bct", w, v).reshape(bs, -1, length)


class QKVAttention(nn.Module):
  """``[q | k | v]`` first, then heads."""

  def __init__(self, n_heads: int):
    super().__init__()
    self.n_heads = n_heads

  def forward(self, qkv: torch.Tensor) -> torch.Tensor:
    bs, width, length = qkv.shape
    ch = width // (3 * self.n_heads)
    q, k, v = qkv.chunk(3, dim=1)
    scale = 1 / math.sqrt(math.sqrt(ch))
    w = torch.einsum("bct,bcs->bts", (q * scale).reshape(bs * self.n_heads, ch, length),
                     (k * scale).reshape(bs * self.n_heads, ch, length))
    w = torch.softmax(w.float(), dim=-1).type(w.dtype)
    return torch.einsum("bts,bcs->bct", w, v.reshape(bs * self.n_heads, ch, length)).reshape(bs, -1, length)


class AttentionBlock(nn.Module):

  def __init__(self, channels: int, num_heads: int = 1, num_head_channels: int = -1,
               use_new_attention_order: bool = False):
    super().__init__()
    self.num_heads = num_heads if num_head_channels == -1 else channels // num_head_channels
    self.norm = normalization(channels)
    self.qkv = nn.Conv1d(channels, channels * 3, 1)
    self.attention = (QKVAttention if use_new_attention_order else QKVAttentionLegacy)(self.num_heads)
    self.proj_out = zero_module(nn.Conv1d(channels, channels, 1))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, c, *spatial = x.shape
    x = x.reshape(b, c, -1)
    h = self.proj_out(self.attention(self.qkv(self.norm(x))))
    return (x + h).reshape(b, c, *spatial)


class UNetModel(nn.Module):
  """``UNetModel(image_size, in_channels, model_channels, out_channels, num_res_blocks, attention_resolutions,
  ...)`` with the official's arguments (``attention_resolutions`` as downsampling rates)."""

  def __init__(self, image_size: int, in_channels: int, model_channels: int, out_channels: int,
               num_res_blocks: int, attention_resolutions, dropout: float = 0.0, channel_mult=(1, 2, 4, 8),
               num_classes: Optional[int] = None, num_heads: int = 1, num_head_channels: int = -1,
               num_heads_upsample: int = -1, use_scale_shift_norm: bool = False, resblock_updown: bool = False,
               use_new_attention_order: bool = False):
    super().__init__()
    if num_heads_upsample == -1:
      num_heads_upsample = num_heads
    self.model_channels = model_channels
    self.num_classes = num_classes
    emb_dim = model_channels * 4
    self.time_embed = nn.Sequential(nn.Linear(model_channels, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
    if num_classes is not None:
      self.label_emb = nn.Embedding(num_classes, emb_dim)

    def res(ch_in, ch_out, **kw):
      return ResBlock(ch_in, emb_dim, dropout, out_channels=ch_out, use_scale_shift_norm=use_scale_shift_norm, **kw)

    def attn(ch, heads):
      return AttentionBlock(ch, num_heads=heads, num_head_channels=num_head_channels,
                            use_new_attention_order=use_new_attention_order)

    ch = input_ch = int(channel_mult[0] * model_channels)
    self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, ch, 3, padding=1))])
    chans, ds = [ch], 1
    for level, mult in enumerate(channel_mult):
      for _ in range(num_res_blocks):
        layers = [res(ch, int(mult * model_channels))]
        ch = int(mult * model_channels)
        if ds in attention_resolutions:
          layers.append(attn(ch, num_heads))
        self.input_blocks.append(TimestepEmbedSequential(*layers))
        chans.append(ch)
      if level != len(channel_mult) - 1:
        self.input_blocks.append(TimestepEmbedSequential(
            res(ch, ch, down=True) if resblock_updown else Downsample(ch, True, out_channels=ch)))
        chans.append(ch)
        ds *= 2
    self.middle_block = TimestepEmbedSequential(res(ch, ch), attn(ch, num_heads), res(ch, ch))
    self.output_blocks = nn.ModuleList([])
    for level, mult in list(enumerate(channel_mult))[::-1]:
      for i in range(num_res_blocks + 1):
        layers = [res(ch + chans.pop(), int(model_channels * mult))]
        ch = int(model_channels * mult)
        if ds in attention_resolutions:
          layers.append(attn(ch, num_heads_upsample))
        if level and i == num_res_blocks:
          layers.append(res(ch, ch, up=True) if resblock_updown else Upsample(ch, True, out_channels=ch))
          ds //= 2
        self.output_blocks.append(TimestepEmbedSequential(*layers))
    self.out = nn.Sequential(normalization(ch), nn.SiLU(),
                             zero_module(nn.Conv2d(input_ch, out_channels, 3, padding=1)))

  def forward(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    assert (y is not None) == (self.num_classes is not None), "y if and only if class-conditional"
    emb = self.time_embed(timestep_embedding(timesteps, self.model_channels))
    if self.num_classes is not None:
      emb = emb + self.label_emb(y)
    hs, h = [], x
    for module in self.input_blocks:
      h = module(h, emb)
      hs.append(h)
    h = self.middle_block(h, emb)
    for module in self.output_blocks:
      h = module(torch.cat([h, hs.pop()], dim=1), emb)
    return self.out(h)


def build(cfg: UNetConfig) -> UNetModel:
  """The official model for a `UNetConfig`: attention resolutions (px) become downsampling rates
  ``image_size // r`` as ``script_util.create_model`` computes them."""
  return UNetModel(
      image_size=cfg.image_size, in_channels=cfg.in_channels, model_channels=cfg.num_channels,
      out_channels=cfg.out_channels, num_res_blocks=cfg.num_res_blocks,
      attention_resolutions=tuple(cfg.image_size // r for r in cfg.attention_resolutions), dropout=cfg.dropout,
      channel_mult=cfg.channel_mult, num_classes=NUM_CLASSES if cfg.class_cond else None, num_heads=cfg.num_heads,
      num_head_channels=cfg.num_head_channels, num_heads_upsample=cfg.num_heads_upsample,
      use_scale_shift_norm=cfg.use_scale_shift_norm, resblock_updown=cfg.resblock_updown,
      use_new_attention_order=cfg.use_new_attention_order)


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
  """Random weights everywhere, the official's zeroed output convs included (zeroed, they would hide
  ``out_layers.3``, ``proj_out`` and ``out.2`` from any comparison): torch's default init for the convs and
  linears, N(0, 1) for the label embedding, scale in [0.5, 1.5] and bias N(0, 0.1) for the GroupNorms."""
  torch.manual_seed(seed)
  for m in model.modules():
    if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear, nn.Embedding)):
      m.reset_parameters()
    elif isinstance(m, nn.GroupNorm):
      m.weight.uniform_(0.5, 1.5)
      m.bias.normal_(0.0, 0.1)
  return model
