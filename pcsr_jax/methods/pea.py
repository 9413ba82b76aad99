"""PEA (Xiao et al., ICLR 2026): progressive embedding alignment, backprop-free, two forward passes per view.

As its official code runs it on a ViT (``TheMaXiao/PEA_TTA`` @ e8b98da: ``pea_vit.py``, ``main_vit.py`` and the
README's ImageNet-C command: ``--exp_type continual --source_stats_samples 50000 --batch_size 64
--use_augmentation --n_aug_max 2 --microbatch_variants 1``; line numbers counted in the stored files):

* Nothing is trained and there is no backward pass. Every block's output tokens are moved towards the source
  distribution by a weighted CORAL step: ``X + w_l (Y - X)`` with ``Y = (X - mu_t) Sigma_t^{-1/2}
  Sigma_s^{1/2} + mu_s`` over *all* tokens (``pea_vit.py`` l. 340-364; ``main_vit.py`` l. 326-337 fixes
  ``use_cls_only=False``), ``Sigma_t^{-1/2}`` by eigh with eigenvalues clamped at ``eps = 1e-5`` (l. 47-54),
  per channel group of ``group_size`` (768, ``main_vit.py`` l. 119: one group at ViT-B; `group_size` >= D is
  one group at any width).
* Views (l. 390-433): the batch, its centre crop (ratio 0.9, ``round`` to pixels, torchvision's
  ``center_crop`` offsets) resized back bilinearly (``align_corners=False``), and its horizontal flip: the
  first ``n_aug_max`` (2) of (crop, flip, crop + flip) after the original (``main_vit.py`` l. 127-135).
* Pass 1 (l. 462-524): the *plain* network on every view; per block, the mean and unbiased variance of the
  class tokens of all views (``weight_use_cls_only``, ``main_vit.py`` l. 123) by sums and sums of squares
  (l. 441-459); a score ``||mu_s - mu|| + ||var_s - var||`` against the source statistics (of all tokens), and
  weights ``w_l`` = the scores min-max normalised over the blocks (all 0 when equal).
* Pass 2 (l. 567-596): each view through the aligned network, one after the other (``microbatch_variants`` 1:
  three aligned forwards, each moving the statistics); the prediction is the mean of the views' logits.
  A block with ``w_l < 1e-3`` is left as it is and its statistics do not move (l. 323-325); the MV branch
  (``w_l < 1e-3`` too, l. 335-338) is never reached, so it is not here.
* Target statistics per block (``PEAStatsViT.update``, l. 219-249): the batch's token mean and unbiased
  covariance + ``reg`` I (1e-5); the first batch since a reset sets them; later ones compute
  ``drift = mean |mu_b - mu|`` and its EMA ``s = alpha drift + (1 - alpha) s`` (alpha 0.2, from s = 0); a
  spike (``s > 1e-6`` and ``drift > gamma s``, gamma 4) replaces mean and covariance with the batch's, else
  an EMA with ``momentum`` (0.02). With s = 0 after the first batch, a block's second update is always a
  spike. The inverse root is rebuilt at every forward (``update_every`` 1, l. 341), so the code's cache is not
  state here and ``update_every`` is not offered.
* Entropy reset (``main_vit.py`` l. 374-379, ``pea_vit.py`` l. 251-258): after the prediction, the batch's
  mean entropy e (softmax clamped at 1e-12) against its EMA (weight alpha): ``e > EMA + entropy_threshold``
  (1.0) drops every block's statistics; the EMA then restarts at e.
* Source statistics (``compute_source_stats_vit``, l. 65-148, all tokens, ``main_vit.py`` l. 315-317): per
  block the tokens' mean and unbiased variance (its Welford update, l. 116-123), the covariance from the sum of
  each batch's batch-centred scatter over (n - 1), + ``reg`` I (1e-5), its square root by eigh (eigenvalues
  clamped at 0), then per group the root of that block of ``S S^T`` (l. 151-169). 50,000 random images
  (``--source_stats_samples``); ``--source-data`` here, the seeded selection of `pcsr_jax.source_stats`.
* Resets: the engine's reset per domain is ``--exp_type each_shift_reset`` (``main_vit.py`` l. 347-350);
  ``--setting continual`` keeps the state as the README's ``continual`` does.

Departures and choices the official code leaves open:

* The source statistics are computed in one pass for all blocks in the batches ``--source-data`` yields (the
  code makes one pass per block over a reshuffled loader of batch 64, so its batch-centred covariance sums
  differ slightly per block); the final roots are computed in float64 (the code: float32).
* ``Sigma_t^{-1/2} Sigma_s^{1/2}`` is multiplied first, then applied to the tokens (the code: left to right).
* Ragged batches: padding rows enter no statistic, mean or entropy (the ImageNet loader of the code drops the
  last batch, ``main_vit.py`` l. 261); a batch without a real row leaves the state as it is. The target
  covariance is one ``[T, D]^T [T, D]`` matmul over the batch's tokens: it does not go through ``--row-chunk``.
* ``drift``, its EMA and the entropy EMA are float32 (the code: Python floats).
* The source images are ``--source-data``'s, preprocessed as every method's source statistics here (ImageNet:
  Resize(256) + CenterCrop(224)); the code resizes ImageNet train images to 224 x 224
  (``utils/dataset_config.py`` l. 18-19, ``standard_transform_vit``).
* ``n_aug_max`` above 3 is refused (the code takes the first ``n_aug_max`` of its three augmentations, so any
  larger value is 3).
* Not carried over: ResNet's ``pea_resnet.py``; ``--use_augmentation`` (``n_aug_max=0`` is its off);
  ``--eval_samples`` (the stream's length is the harness's).

Under ``--realtime`` a batch the clock skips gets the network's plain forward (`Method.forward`: the source
model on the batch itself, no view, no alignment), as NEO's and T3A's do (`pcsr_jax.realtime`). Its state is
per block a D-vector, a D x D covariance and the drift EMA (ViT-B: 12 x 768^2 floats, 28 MB).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterator

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, merge, require_head
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array

SKIP_THRESHOLD = 1e-3  # PEAViT._SKIP_THRESHOLD (pea_vit.py l. 275)
SPIKE_FLOOR = 1e-6  # PEAStatsViT.update: a spike needs the smoothed drift above it (l. 240)
AUGMENTATIONS = ("centercrop", "hflip", "centercrop_hflip")  # _tta_candidates' order (l. 390-399)


@flax.struct.dataclass
class TargetStats:
  """``PEAStatsViT``'s state: per block the target token mean, covariance and smoothed drift, whether the block
  has seen a batch since the reset, and the entropy EMA."""

  mean: Array  # [depth, D]
  cov: Array  # [depth, D, D]
  drift: Array  # [depth]
  seen: Array  # [depth] bool
  entropy: Array  # scalar: entropy_smooth
  entropy_seen: Array  # bool scalar: entropy_smooth is not None

  @staticmethod
  def fresh(depth: int, dim: int) -> "TargetStats":
    return TargetStats(mean=jnp.zeros((depth, dim), jnp.float32), cov=jnp.zeros((depth, dim, dim), jnp.float32),
                       drift=jnp.zeros((depth,), jnp.float32), seen=jnp.zeros((depth,), bool),
                       entropy=jnp.zeros((), jnp.float32), entropy_seen=jnp.zeros((), bool))


def view_names(n_aug_max: int, include_original: bool, hflip: bool, center_crop_ratio: float) -> tuple[str, ...]:
  """``_select_tta_names`` (l. 402-413): the original, then the first ``n_aug_max`` augmentations."""
  crop = center_crop_ratio < 1.0
  candidates = [n for n in AUGMENTATIONS if ("crop" not in n or crop) and ("hflip" not in n or hflip)]
  return (("orig",) if include_original else ()) + tuple(candidates[:n_aug_max])


def make_view(images: Array, name: str, center_crop_ratio: float) -> Array:
  """One view of NHWC images (``_apply_variant_cpu``, l. 416-433): crop with torchvision's ``center_crop``
  offsets, resized back bilinearly (half-pixel centres, as ``align_corners=False``), then the flip."""
  x = images
  b, h, w, c = x.shape
  if "centercrop" in name:
    ch, cw = max(1, int(round(h * center_crop_ratio))), max(1, int(round(w * center_crop_ratio)))
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    x = jax.image.resize(x[:, top:top + ch, left:left + cw], (b, h, w, c), "bilinear", antialias=False)
  if "hflip" in name:
    x = x[:, :, ::-1]
  return x


def _embed(module: Any, x: Array) -> Array:
  """The tokens before block 0, as `VisionTransformer.__call__` without prompts: ``[B, T, D]``."""
  x = module.patch_embed(x)
  cls = jnp.broadcast_to(module.cls_token, (x.shape[0], 1, x.shape[-1]))
  pos = module.pos_embed if module.dtype is None else module.pos_embed.astype(module.dtype)
  return jnp.concatenate([cls.astype(x.dtype), x], axis=1) + pos


def _block(module: Any, x: Array, index: int) -> Array:
  return module.blocks[index](x)


def _head(module: Any, x: Array) -> Array:
  return module.classify(module.norm(x.astype(jnp.float32))[:, 0])


def _block_sums(module: Any, x: Array, cls_only: bool) -> tuple[Array, Array]:
  """Pass 1, per row: the sum and the sum of squares of every block's output tokens (the class token alone
  with ``cls_only``) of the plain network, ``[B, depth, D]`` each (``_TokenMVReducer``, l. 441-451)."""
  x = _embed(module, x)
  sums, squares = [], []
  for blk in module.blocks:
    x = blk(x)
    t = (x[:, :1] if cls_only else x).astype(jnp.float32)
    sums.append(jnp.sum(t, axis=1))
    squares.append(jnp.sum(t * t, axis=1))
  return jnp.stack(sums, axis=1), jnp.stack(squares, axis=1)


def _source_welford(module: Any, x: Array, acc: tuple[Array, ...]) -> tuple[Array, ...]:
  """One source batch into ``(n, mean, m2, c2)`` per block: the Welford update and the batch-centred scatter
  of ``compute_source_stats_vit`` (l. 116-127), over all tokens."""
  n, mean, m2, c2 = acc
  x = _embed(module, x)
  out = []
  for i, blk in enumerate(module.blocks):
    x = blk(x)
    t = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    total = n + t.shape[0]
    delta = jnp.mean(t, axis=0) - mean[i]
    new_mean = mean[i] + delta * (t.shape[0] / jnp.maximum(total, 1.0))
    m2_i = m2[i] + jnp.sum((t - (new_mean - delta)) * (t - new_mean), axis=0)
    centred = t - jnp.mean(t, axis=0, keepdims=True)
    out.append((new_mean, m2_i, c2[i] + centred.T @ centred))
  means, m2s, c2s = (jnp.stack(v) for v in zip(*out))
  return n + x.shape[0] * x.shape[1], means, m2s, c2s


def _psd_sqrt(m: np.ndarray) -> np.ndarray:
  """``matrix_sqrt_fp32`` (l. 35-43): symmetrised, eigenvalues clamped at 0, in float64."""
  lam, v = np.linalg.eigh(0.5 * (m + m.T))
  return (v * np.sqrt(np.clip(lam, 0.0, None))) @ v.T


def group_slices(dim: int, group_size: int) -> list[tuple[int, int]]:
  """``_group_slices`` (l. 57-58)."""
  return [(g, min(g + group_size, dim)) for g in range(0, dim, group_size)]


def inv_sqrt(cov: Array, eps: float, group_size: int) -> Array:
  """``Sigma^{-1/2}`` per channel group, as one block-diagonal ``[D, D]`` (``invsqrt_spd``, l. 46-54)."""
  blocks = []
  for s, e in group_slices(cov.shape[0], group_size):
    a = cov[s:e, s:e]
    lam, v = jnp.linalg.eigh(0.5 * (a + a.T))
    blocks.append((v * jax.lax.rsqrt(jnp.maximum(lam, eps))[None]) @ v.T)
  return jax.scipy.linalg.block_diag(*blocks)


@dataclasses.dataclass(frozen=True)
class PEA(Method):
  name: ClassVar[str] = "pea"
  cost: ClassVar[str] = "6F"  # 3 plain forwards (pass 1) + 3 aligned ones (pass 2), one per view
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the aligned forward is the prediction
  source_data: ClassVar[str] = "required"
  source_images: ClassVar[int] = 50_000  # the README's --source_stats_samples 50000

  momentum: float = field(0.02, "[0, 1]")  # main_vit.py l. 113
  alpha: float = field(0.2, "[0, 1]")  # l. 114: the drift's and the entropy's EMA weight
  gamma: float = field(4.0, ">= 0")  # l. 115: a drift spike is drift > gamma * its EMA
  entropy_threshold: float = field(1.0, ">= 0")  # l. 116
  reset_on_entropy_spike: bool = True  # l. 138
  group_size: int = field(768, ">= 1")  # l. 119 (ViT-B's width: one group)
  n_aug_max: int = field(2, "[0, 3]")  # l. 129
  center_crop_ratio: float = field(0.9, "(0, 1]")  # l. 130
  hflip: bool = True  # l. 131
  include_original: bool = True  # l. 133
  microbatch_variants: int = field(1, ">= 1")  # l. 135 and the README: views through pass 2 one at a time
  weight_use_cls_only: bool = True  # l. 123: pass 1 reads the class tokens
  reg: float = field(1e-5, ">= 0")  # pea_vit.py l. 72, 197: added to both covariances' diagonals
  eps: float = field(1e-5, "> 0")  # l. 289: the target eigenvalues' floor

  def __post_init__(self):
    super().__post_init__()
    if not self.views():
      raise UserError("pea include_original: expected True when n_aug_max is 0 (no view would be left), got False")

  def views(self) -> tuple[str, ...]:
    return view_names(self.n_aug_max, self.include_original, self.hflip, self.center_crop_ratio)

  def stats_key(self) -> str:
    return f"pea-g{self.group_size}-reg{self.reg:g}"

  def prepare(self, model, params, rng, batch_size):
    require_head("pea", model, params)
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def init_extra(self, prep, trainable, opt_state):
    """No statistics (``PEAStatsViT()``), after a reset too (``stats.reset()``, ``main_vit.py`` l. 347-350)."""
    return TargetStats.fresh(prep.model.config.depth, prep.model.config.embed_dim)

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per block: the tokens' mean, unbiased variance and the grouped root of their covariance (module doc)."""
    variables = {"params": merge(frozen, trainable)}
    step = jax.jit(lambda x, acc: prep.model.apply(variables, x, acc, method=_source_welford))
    depth, d = prep.model.config.depth, prep.model.config.embed_dim
    acc = (jnp.zeros((), jnp.float32), jnp.zeros((depth, d)), jnp.zeros((depth, d)), jnp.zeros((depth, d, d)))
    for images, _ in batches:
      acc = step(jnp.asarray(images, jnp.float32), acc)
    n, mean, m2, c2 = (np.asarray(a, np.float64) for a in acc)
    if n < 2:
      raise UserError(f"pea: the source statistics need at least 2 source tokens, got {int(n)}")
    cov = c2 / (n - 1) + self.reg * np.eye(d)
    roots = np.zeros((depth, d, d))
    for i in range(depth):
      s = _psd_sqrt(cov[i])
      full = s @ s.T  # _build_source_cov_groups_vit (l. 163): the covariance back from its root
      for a, b in group_slices(d, self.group_size):
        roots[i, a:b, a:b] = _psd_sqrt(full[a:b, a:b])
    return {"mean": mean.astype(np.float32), "var": (m2 / (n - 1)).astype(np.float32),
            "cov_sqrt": roots.astype(np.float32)}

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    del frozen, trainable
    depth, d = prep.model.config.depth, prep.model.config.embed_dim
    return {"mean": jax.ShapeDtypeStruct((depth, d), np.float32), "var": jax.ShapeDtypeStruct((depth, d), np.float32),
            "cov_sqrt": jax.ShapeDtypeStruct((depth, d, d), np.float32)}

  def block_weights(self, prep: Prepared, variables: dict, views: list[Array], valid: Array) -> Array:
    """Pass 1 (``_compute_block_weights_vit``): ``[depth]`` weights in [0, 1] from the plain network's views."""
    rows = jnp.concatenate(views)
    sums, squares = in_row_passes(
        prep, lambda x: prep.model.apply(variables, x, self.weight_use_cls_only, method=_block_sums), rows)
    keep = jnp.tile(valid, len(views)).astype(jnp.float32)[:, None, None]
    per_row = 1 if self.weight_use_cls_only else prep.model.config.num_patches + 1
    count = jnp.maximum(jnp.sum(keep) * per_row, 1.0)
    mu = jnp.sum(sums * keep, axis=0) / count
    var = jnp.maximum(jnp.sum(squares * keep, axis=0) / count - mu * mu, 0.0) * (count / jnp.maximum(count - 1, 1))
    src = prep.consts
    scores = jnp.linalg.norm(src["mean"] - mu, axis=-1) + jnp.linalg.norm(src["var"] - var, axis=-1)
    lo, hi = jnp.min(scores), jnp.max(scores)
    return jnp.where(hi > lo, (scores - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)

  def align(self, prep: Prepared, x: Array, keep_rows: Array, index: int, w: Array,
            stats: TargetStats) -> tuple[Array, TargetStats, dict[str, Array]]:
    """``PEAViT._align_block`` on block ``index``'s output ``x`` ``[R, T, D]`` (rows where ``keep_rows``)."""
    d = x.shape[-1]
    tokens = x.astype(jnp.float32).reshape(-1, d)
    keep = jnp.repeat(keep_rows, x.shape[1])
    n = jnp.sum(keep.astype(jnp.float32))
    mu_b = jnp.sum(jnp.where(keep[:, None], tokens, 0.0), axis=0) / jnp.maximum(n, 1.0)
    centred = jnp.where(keep[:, None], tokens - mu_b, 0.0)
    cov_b = centred.T @ centred / jnp.maximum(n - 1.0, 1.0) + self.reg * jnp.eye(d)
    seen, mu, cov, smooth = stats.seen[index], stats.mean[index], stats.cov[index], stats.drift[index]
    drift = jnp.mean(jnp.abs(mu_b - mu))
    smoothed = self.alpha * drift + (1.0 - self.alpha) * smooth
    spike = seen & (smoothed > SPIKE_FLOOR) & (drift > self.gamma * smoothed)
    take = ~seen | spike
    mu_new = jnp.where(take, mu_b, self.momentum * mu_b + (1.0 - self.momentum) * mu)
    cov_new = jnp.where(take, cov_b, self.momentum * cov_b + (1.0 - self.momentum) * cov)
    drift_new = jnp.where(seen, smoothed, 0.0)
    active = (w >= SKIP_THRESHOLD) & (n > 0)
    transform = inv_sqrt(cov_new, self.eps, self.group_size) @ prep.consts["cov_sqrt"][index]
    mu_src = prep.consts["mean"][index]

    def move(t):
      f = t.astype(jnp.float32)
      y = (f - mu_new) @ transform + mu_src
      return (f + w * (y - f)).astype(t.dtype)

    x = jnp.where(active, in_row_passes(prep, move, x), x)
    stats = stats.replace(mean=stats.mean.at[index].set(jnp.where(active, mu_new, mu)),
                          cov=stats.cov.at[index].set(jnp.where(active, cov_new, cov)),
                          drift=stats.drift.at[index].set(jnp.where(active, drift_new, smooth)),
                          seen=stats.seen.at[index].set(seen | active))
    counts = {"aligned": active.astype(jnp.int32), "spikes": (active & spike).astype(jnp.int32),
              "first": (active & ~seen).astype(jnp.int32)}
    return x, stats, counts

  def aligned_forward(self, prep: Prepared, variables: dict, rows: Array, keep_rows: Array, w: Array,
                      stats: TargetStats) -> tuple[Array, TargetStats, dict[str, Array]]:
    """``PEAViT.forward`` (l. 367-383): each block, then its alignment; the logits of ``rows``."""
    x = in_row_passes(prep, lambda r: prep.model.apply(variables, r, method=_embed), rows)
    counts = {"aligned": 0, "spikes": 0, "first": 0}
    for i in range(prep.model.config.depth):
      x = in_row_passes(prep, lambda t, i=i: prep.model.apply(variables, t, i, method=_block), x)
      x, stats, c = self.align(prep, x, keep_rows, i, w[i], stats)
      counts = {k: counts[k] + c[k] for k in counts}
    logits = in_row_passes(prep, lambda t: prep.model.apply(variables, t, method=_head), x)
    return logits, stats, counts

  def update(self, prep, frozen, state, images, valid):
    variables = {"params": merge(frozen, state.trainable)}
    names = self.views()
    views = [make_view(images, n, self.center_crop_ratio) for n in names]
    w = self.block_weights(prep, variables, views, valid)
    stats, b = state.extra, images.shape[0]
    logits_sum, counts = 0.0, {"aligned": 0, "spikes": 0, "first": 0}
    for s in range(0, len(names), self.microbatch_variants):  # pea_vit_infer's chunks of views (l. 583-593)
      chunk = views[s:s + self.microbatch_variants]
      out, stats, c = self.aligned_forward(prep, variables, jnp.concatenate(chunk), jnp.tile(valid, len(chunk)),
                                           w, stats)
      logits_sum = logits_sum + jnp.sum(out.reshape(len(chunk), b, -1), axis=0)
      counts = {k: counts[k] + c[k] for k in counts}
    logits = logits_sum / len(names)
    # entropy_from_logits (l. 599-602) over the real rows, then the reset policy of main_vit.py l. 374-379
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    ent = losses.masked_mean(-jnp.sum(p * jnp.log(jnp.maximum(p, 1e-12)), axis=-1), valid)
    reset = self.reset_on_entropy_spike & stats.entropy_seen & (ent > stats.entropy + self.entropy_threshold)
    fresh = TargetStats.fresh(*stats.mean.shape)
    stats = jax.tree.map(lambda f, s: jnp.where(reset, f, s), fresh, stats)
    smooth = jnp.where(stats.entropy_seen, self.alpha * ent + (1.0 - self.alpha) * stats.entropy, ent)
    stats = stats.replace(entropy=smooth, entropy_seen=jnp.ones((), bool))
    any_valid = jnp.any(valid)
    stats = jax.tree.map(lambda new, old: jnp.where(any_valid, new, old), stats, state.extra)
    metrics = {"entropy": ent, "entropy_smooth": stats.entropy, "reset": reset.astype(jnp.int32),
               "skipped": jnp.sum(w < SKIP_THRESHOLD).astype(jnp.int32), "weight_mean": jnp.mean(w), **counts}
    return state.replace(step=state.step + 1, extra=stats), logits, metrics
