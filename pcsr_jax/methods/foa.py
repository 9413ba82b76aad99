"""FOA (Niu et al., ICML 2024): forward-only adaptation, as in ``mr-eggplant/FOA``.

``tta_library/foa.py``, ``models/vpt.py`` and ``main.py``:

* Adapted: ``num_prompts`` (3) prompt tokens of width D, inserted after the class token and before the
  patch tokens, after the position embedding. No weight changes and no gradient: the prompts
  are searched by CMA-ES (`pcsr_jax.cmaes`: pycma's defaults, x0 = 0, sigma0 = 1, popsize 27 =
  4 + 3 ln(3 * 768)). The first "previous best" is the VPT initialization, Xavier-uniform with
  bound ``sqrt(6 / (3 * patch^2 + D))``.
* Per batch (28 forwards, 0 backwards): the 27 new samples plus the previous best are each run
  on the batch; fitness = sum over the batch of the entropy of the (unshifted) logits
  + lambda * (||std_b - std_src||^2 + ||mean_b - mean_src||^2) * B / 64, over the
  per-layer class-token features (every block's output normalised by the next block's norm1,
  the last by the final norm; ``[depth * D]``). ``std`` is torch's unbiased ``std_mean``.
  All 28 are told to CMA-ES; the next previous best is this batch's lowest fitness.
* Activation shifting (eq. 7-9): the prediction is ``head(cls_last + mu_src,last - h)``
  where ``h`` is an EMA (``h <- 0.9 h + 0.1 m``, the first batch sets it) of ``m``, the mean
  over the 28 candidates of the batch mean of the last-layer feature. ``h`` is updated after
  the forwards, so the first batch is not shifted. The reported logits are those of this
  batch's best candidate (prediction "before" the update; ``eval_orders = ("before",)``:
  an "after" forward would have no defined prompt or shift).
* Source statistics: mean and unbiased std of the per-layer features *without prompts* over
  all clean source images (the official loops over all of ImageNet val; its ``break`` is
  commented out).

Padded rows are excluded from every statistic and sum; ``B`` is the number of valid rows (a batch
with a single valid row leaves out the std term, where torch's would be NaN).
Deviations: JAX's random numbers instead of numpy's (seed 2020) for the CMA-ES samples, and
the initial prompts are drawn from ``seed`` once, so every domain (reset) starts from the same
prompts, where the official re-draws them from torch's global stream at each ``reset()``.
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
from pcsr_jax.cmaes import CMAES, CMAState
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, image_shape, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.models import vit

Array = jax.Array


@flax.struct.dataclass
class FOAState:
  """CMA-ES state, the previous batch's best prompts ``[P * D]`` and the activation-shift EMA ``[D]``."""

  es: CMAState
  best: Array
  hist: Array
  hist_valid: Array


def masked_std_mean(x: Array, valid: Array) -> tuple[Array, Array]:
  """torch.std_mean(x, dim=0) (unbiased std) over the rows where ``valid``."""
  w = valid.astype(x.dtype)[:, None]
  n = jnp.sum(w)
  mean = jnp.sum(x * w, axis=0) / n
  var = jnp.sum(jnp.square(x - mean) * w, axis=0) / (n - 1)
  return jnp.sqrt(var), mean


def _layer_cls_features(prep: Prepared, frozen: Any, trainable: Any):
  """images -> [B, depth * D]: every layer's class-token feature (`layer_cls_stats`), no prompts."""
  variables = {"params": merge(frozen, trainable)}
  return lambda x: prep.model.apply(variables, x, return_cls=True)[1].reshape(x.shape[0], -1)


def layer_cls_stats(name: str, prep: Prepared, frozen: Any, trainable: Any,
                    batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
  """Mean and unbiased std over all ``batches`` of the per-layer class-token features without prompts: FOA's
  source statistics, and FOZO's (``name`` in the error)."""
  features = jax.jit(_layer_cls_features(prep, frozen, trainable))
  n, total, total_sq = 0, 0.0, 0.0
  for images, _ in batches:
    f = np.asarray(features(images), np.float64)
    n, total, total_sq = n + len(f), total + f.sum(0), total_sq + np.square(f).sum(0)
  if n < 2:  # an unbiased std needs two
    raise UserError(f"{name}: the source statistics need at least 2 source images, got {n}")
  mean = total / n
  std = np.sqrt(np.maximum(total_sq - n * np.square(mean), 0.0) / (n - 1))
  return {"mean": mean.astype(np.float32), "std": std.astype(np.float32)}


def layer_cls_stats_shapes(prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes `layer_cls_stats` returns for ``prep.model``, without computing them."""
  d = jax.eval_shape(_layer_cls_features(prep, frozen, trainable), image_shape(prep.model)).shape[-1]
  return {k: jax.ShapeDtypeStruct((d,), np.float32) for k in ("mean", "std")}


@dataclasses.dataclass(frozen=True)
class FOA(Method):
  name: ClassVar[str] = "foa"
  cost: ClassVar[str] = "28F"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)
  source_data: ClassVar[str] = "required"  # source_images None: all of them

  num_prompts: int = field(3, ">= 1")
  popsize: int = field(27, ">= 3")  # 4 + 3 ln(3 * 768), fixed in the official code
  fitness_lambda: float = field(0.4, ">= 0")  # 0.2 for ImageNet-R
  sigma0: float = field(1.0, "> 0")  # CMA-ES's initial step size (0: no search, a division by 0)
  shift: bool = True  # activation shifting (eq. 7)
  seed: int = field(2020, ">= 0")  # the initial prompts
  # Candidates evaluated at once (jax.lax.map batch_size). 0: all 28 on a GPU/TPU, one at a time on a CPU, where a
  # 28x larger batch runs slower per image (ViT-S/16, batch 16, 2 cores: 34 s per step against 27.5 s).
  chunk: int = field(0, ">= 0")

  def prepare(self, model, params, rng, batch_size):
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def cma(self, model) -> CMAES:
    return CMAES(self.num_prompts * model.config.embed_dim, self.popsize, self.sigma0)

  def initial_prompts(self, model) -> Array:
    """VPT's Xavier-uniform init of the ``[P, D]`` prompts (``models/vpt.py``)."""
    return vit.vpt_prompts(model.config, self.num_prompts, self.seed)

  def init_extra(self, prep, trainable, opt_state):
    es = self.cma(prep.model)
    d = prep.model.config.embed_dim
    return FOAState(es=es.init(jnp.zeros(es.dim)), best=self.initial_prompts(prep.model).reshape(-1),
                    hist=jnp.zeros(d), hist_valid=jnp.zeros((), bool))

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Mean and unbiased std over all source images of the per-layer class-token features, no prompts."""
    return layer_cls_stats(self.name, prep, frozen, trainable, batches)

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    return layer_cls_stats_shapes(prep, frozen, trainable)

  def evaluate(self, prep: Prepared, frozen: Any, images: Array, valid: Array, prompts: Array,
               shift: Array) -> tuple[Array, Array, Array]:
    """One candidate's ``(fitness, reported logits, batch mean of the last-layer feature)``.

    ``prompts`` is ``[P, D]``; ``shift`` ``[D]`` is added to the last-layer feature for the
    reported logits (zeros: no shifting).
    """
    variables = {"params": frozen}
    logits, cls = in_row_passes(prep, lambda x: prep.model.apply(variables, x, prompts=prompts, return_cls=True),
                                images)
    b, depth, d = cls.shape
    std, mean = masked_std_mean(cls.reshape(b, depth * d), valid)
    n = jnp.sum(valid)
    # One valid row has no std (torch: NaN, which would poison the CMA-ES state): its term is left out.
    std_term = jnp.where(n > 1, jnp.sum(jnp.square(std - prep.consts["std"])), 0.0)
    discrepancy = self.fitness_lambda * (std_term + jnp.sum(jnp.square(mean - prep.consts["mean"]))) * n / 64
    fitness = jnp.sum(jnp.where(valid, losses.entropy(logits), 0.0)) + discrepancy
    shifted = prep.model.apply(variables, cls[:, -1] + shift, method=prep.model.classify)
    return fitness, shifted, mean[-d:]

  def update(self, prep, frozen, state, images, valid):
    rng, key = jax.random.split(state.rng)
    samples, es_state = self.cma(prep.model).ask(key, state.extra.es)
    state = state.replace(rng=rng, extra=state.extra.replace(es=es_state))
    state, logits, metrics, _ = self.adapt(prep, frozen, state, images, valid, samples)
    return state, logits, metrics

  def adapt(self, prep: Prepared, frozen: Any, state: Any, images: Array, valid: Array,
            samples: Array) -> tuple[Any, Array, dict[str, Array], Array]:
    """The step after ``ask``: evaluate ``samples`` ``[popsize, P * D]`` and the previous best, tell.

    Returns ``(state, logits, metrics, fitness of the popsize + 1 candidates)``.
    """
    foa: FOAState = state.extra
    d = prep.model.config.embed_dim
    candidates = jnp.concatenate([samples, foa.best[None]])  # the previous best last, as the official
    shift = jnp.where(foa.hist_valid & self.shift, prep.consts["mean"][-d:] - foa.hist, 0.0)

    def one(prompts):
      return self.evaluate(prep, frozen, images, valid, prompts.reshape(self.num_prompts, d), shift)

    chunk = self.chunk or (1 if prep.platform == "cpu" else candidates.shape[0])
    fitness, logits, means = jax.lax.map(one, candidates, batch_size=chunk)
    best = jnp.argmin(fitness)  # the first of equal minima, as the official's strict `>`
    sampled = jnp.arange(candidates.shape[0]) < samples.shape[0]
    es_state = self.cma(prep.model).tell(foa.es, candidates, fitness, sampled)
    m = jnp.mean(means, axis=0)
    hist = jnp.where(foa.hist_valid, 0.9 * foa.hist + 0.1 * m, m)
    extra = FOAState(es=es_state, best=candidates[best], hist=hist, hist_valid=jnp.ones((), bool))
    state = state.replace(extra=extra, step=state.step + 1)
    metrics = {"fitness": fitness[best], "sigma": es_state.sigma,
               "best_is_previous": (best == samples.shape[0]).astype(jnp.int32)}
    return state, logits[best], metrics, fitness
