"""PCSR: Progressive Conditioned Scale-Shift Recalibration of self-attention.

Per transformer layer l (paper, Sec. 3):

* Domain Separation Network ``DSN_l`` (Linear d->d) maps every patch token;
  aggregating its outputs gives the Domain token ``D_l`` (eq. 1).
* Factor Generator Network ``FGN_l`` (Linear d->2d) maps the Domain token and
  the Class token ``C_l`` to per-sample ``gamma_l, beta_l`` (eq. 4).
* ``Q' = gamma*Q + beta``, ``K' = gamma*K + beta``, ``V' = gamma*V + beta``
  (eq. 5, factors shared by Q, K, V), then ordinary softmax attention.
* The DSN outputs ``f`` also feed the similarity loss (eqs. 2-3), sown into the
  ``'losses'`` collection as the per-sample mean pairwise cosine of each layer.

Choices the paper leaves open (defaults per reference-protocols.md, Sec. 1;
each is a field of `PCSRConfig`):

* DSN/FGN input: the attention block's input after norm1 (patch tokens 1: for
  the DSN, token 0 as C_l); ``dsn_input='block_input'`` takes it before norm1.
* How D_l and C_l meet the d->2d FGN: their sum (``combine='sum'``); ``'mean'``
  halves it; ``'concat'`` feeds [D_l, C_l] to a 2d->2d Linear.
* FGN init: zero weights and bias with ``gamma = 1 + out[:d]``,
  ``beta = out[d:]`` (adaLN-Zero), so the adapted model equals the source model
  exactly at step 0; ``fgn_init='default'`` uses a PyTorch-default Linear init.
* DSN init: PyTorch's default Linear init, U(+-1/sqrt(d)) for weight and bias
  (what ``nn.Linear(d, d)`` gives in the authors' PyTorch setting);
  ``dsn_init='identity'`` starts at the identity map (D_l = the mean token).
* Recalibrated tokens: all tokens, all heads; gamma, beta in R^d split per head
  exactly like Q.
* One DSN+FGN pair per layer (the equations' superscript l). The paper's
  "about 1.7M extra parameters" equals *one* pair at d=768 (3d^2 + 3d =
  1,771,776), so ``shared_across_layers=True`` offers one pair for all layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pcsr_jax.errors import UserError, check_fields
from pcsr_jax.losses import mean_pairwise_cosine

Array = jax.Array

CONDITIONS = ("class+domain", "class", "domain", "mean")
AGGREGATIONS = ("avg", "max", "attention")
COMBINES = ("sum", "mean", "concat")


def torch_linear_init(fan_in: int):
  """PyTorch's default ``nn.Linear`` init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (weight and bias)."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


@dataclasses.dataclass(frozen=True)
class PCSRConfig:
  """Architecture of the PCSR recalibrators (paper defaults; ablations of Tables 3-5)."""

  condition: str = "class+domain"  # Table 3: FGN conditioned on class / mean / domain / class+domain token
  aggregation: str = "avg"  # Table 4: avg / max / attention pooling of the DSN outputs
  qkv_factors: str = "shared"  # Table 5: one (gamma, beta) for Q, K and V, or "independent" per Q, K, V
  shared_across_layers: bool = False  # one DSN+FGN pair for all layers instead of one per layer
  skip_blocks: tuple[int, ...] = ()  # blocks without recalibration: () the paper's "each layer"; DCT's (9, 10, 11)
  dsn_input: str = "norm1"  # "norm1" (after the block's first LayerNorm) or "block_input"
  combine: str = "sum"  # how D_l and C_l enter the FGN: "sum", "mean" or "concat" (2d->2d Linear)
  fgn_init: str = "zero"  # "zero" (identity at step 0) or "default" (PyTorch Linear init)
  dsn_init: str = "default"  # "default" (PyTorch Linear init) or "identity"

  def __post_init__(self):
    for field, allowed in (("condition", CONDITIONS), ("aggregation", AGGREGATIONS), ("combine", COMBINES),
                           ("qkv_factors", ("shared", "independent")), ("dsn_input", ("norm1", "block_input")),
                           ("fgn_init", ("zero", "default")), ("dsn_init", ("default", "identity"))):
      if getattr(self, field) not in allowed:
        raise UserError(f"pcsr {field}: expected one of {', '.join(allowed)}, got '{getattr(self, field)}'")
    if not isinstance(self.skip_blocks, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.skip_blocks):
      raise UserError(f"pcsr config skip_blocks: expected a tuple of integers >= 0, got {self.skip_blocks!r}")

  @property
  def uses_dsn(self) -> bool:
    return self.condition in ("domain", "class+domain")

  def make(self, dtype: Any = None) -> "PCSRRecalibrator":
    """A fresh recalibrator (the `vit.Recalibration` protocol) computing in the backbone's ``dtype``."""
    return PCSRRecalibrator(self, dtype)

  @staticmethod
  def from_dict(d: dict[str, Any]) -> "PCSRConfig":
    check_fields(PCSRConfig, d, "pcsr config")
    d = dict(d)
    if "skip_blocks" in d:  # a JSON list
      d["skip_blocks"] = tuple(d["skip_blocks"])
    return PCSRConfig(**d)


class PCSRRecalibrator(nn.Module):
  """DSN + aggregation + FGN of one layer: ``(x, h) -> (gamma, beta)``, each ``[B, S, D]``.

  ``dtype`` (None: float32) is the DSN's and FGN's compute dtype; their params, the similarity statistic and
  the attention pooling's softmax stay float32.
  """

  config: PCSRConfig
  dtype: Any = None

  @nn.compact
  def __call__(self, x: Array, h: Array) -> tuple[Array, Array]:
    c = self.config
    tokens = h if c.dsn_input == "norm1" else x
    cls_tok, patches = tokens[:, 0], tokens[:, 1:]
    d = tokens.shape[-1]

    if c.uses_dsn:
      if c.dsn_init == "identity":
        kinit, binit = (lambda key, shape, dtype=jnp.float32: jnp.eye(*shape, dtype=dtype)), nn.initializers.zeros
      else:
        kinit = binit = torch_linear_init(d)
      f = nn.Dense(d, kernel_init=kinit, bias_init=binit, dtype=self.dtype, name="dsn")(patches)
      self.sow("losses", "similarity", mean_pairwise_cosine(f))  # [B], for eq. 3
      domain = self._aggregate(f)
      self.sow("intermediates", "domain_token", domain)
    if c.condition == "class":
      cond = cls_tok
    elif c.condition == "mean":
      cond = jnp.mean(patches, axis=1)  # Table 3's "mean token": patch average, no DSN
    elif c.condition == "domain":
      cond = domain
    elif c.combine == "concat":
      cond = jnp.concatenate([domain, cls_tok], axis=-1)
    else:
      cond = domain + cls_tok if c.combine == "sum" else 0.5 * (domain + cls_tok)

    s = 3 if c.qkv_factors == "independent" else 1
    fan_in = cond.shape[-1]
    init = nn.initializers.zeros if c.fgn_init == "zero" else torch_linear_init(fan_in)
    out = nn.Dense(2 * s * d, kernel_init=init, bias_init=init, dtype=self.dtype, name="fgn")(cond)
    gamma, beta = jnp.split(out, 2, axis=-1)
    b = out.shape[0]
    return 1.0 + gamma.reshape(b, s, d), beta.reshape(b, s, d)

  def _aggregate(self, f: Array) -> Array:
    agg = self.config.aggregation
    if agg == "avg":
      return jnp.mean(f, axis=1)  # eq. 1
    if agg == "max":
      return jnp.max(f, axis=1)
    # Attention pooling with a learned query (zero init = average pooling at step 0).
    q = self.param("pool_query", nn.initializers.zeros, (f.shape[-1],))
    w = jax.nn.softmax(jnp.einsum("bnd,d->bn", f, q) / math.sqrt(f.shape[-1]), axis=-1)
    return jnp.einsum("bn,bnd->bd", w, f)


def param_group(path: tuple[str, ...]) -> str:
  """'dsn' or 'fgn': which learning rate a recalibrator parameter gets.

  The attention-pooling query belongs to the Domain token's extraction, so it
  trains with the DSN.
  """
  return "fgn" if "fgn" in path else "dsn"


def num_params(config: PCSRConfig, embed_dim: int, depth: int) -> int:
  """Extra parameters PCSR adds to a ViT of width ``embed_dim`` and ``depth`` layers."""
  d = embed_dim
  s = 3 if config.qkv_factors == "independent" else 1
  fan_in = 2 * d if (config.condition == "class+domain" and config.combine == "concat") else d
  per = (fan_in + 1) * 2 * s * d
  if config.uses_dsn:
    per += d * d + d + (d if config.aggregation == "attention" else 0)
  layers = sum(i not in config.skip_blocks for i in range(depth))
  return per * (1 if config.shared_across_layers else layers)
