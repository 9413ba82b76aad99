"""FOZO (Wang et al., CVPR 2026, arXiv 2603.04733): forward-only zeroth-order prompt optimisation.

As its official code runs it (``eVI-group-SCU/FOZO`` @ 5bc3e5c; line numbers counted in the stored files,
``tta_library/FOZO.py`` unless named):

* Adapted: ``num_prompts`` (3, ``main.py`` l. 142) prompt tokens of width D, inserted after the class token and
  before the patch tokens, after the position embedding (``models/vpt.py`` l. 33-48, the same `vit.ViT` prompts
  as FOA), initialised Xavier-uniform with bound ``sqrt(6 / (3 p^2 + D))`` (``models/vpt.py`` l. 25-26). No
  weight changes and no backward pass.
* The loss of prompts P on a batch (``forward_and_get_loss``, l. 22-74): the sum over the batch of the entropy
  of the *shifted* logits ``head(cls_last + shift)`` (l. 58-67; FOA's fitness takes the unshifted ones) plus
  ``fitness_lambda`` (0.4, l. 82) times the squared distances of the batch's unbiased std and mean to the source
  ones, times B / 64 (l. 44-55), over every layer's class-token feature (each block's output normalised by the
  next block's norm1, the last by the final norm: ``models/vpt.py`` l. 50-60, FOA's features). The code splits
  the layers into a shallow and a deep half (l. 40-41) with their own statistics (l. 298-299); a std or mean
  over dim 0 is per feature, so the sum over both halves is the sum over all layers, computed here in one.
* Per batch (``zo_step``, l. 150-196, with ``n_spsa`` = 1, l. 82): for each of ``n_spsa`` draws
  ``Z ~ N(0, I)`` (l. 143), the losses l+ at ``P + eps Z`` and l- at ``P - eps Z`` (two forwards, l. 166-184)
  and ``g = (l+ - l-) / (2 eps)`` (l. 188). The prompts are moved in place, ``+eps Z``, ``-2 eps Z``,
  ``+eps Z`` (l. 166, 177, 191), so the restored P carries float32 rounding: reproduced here. The reported
  logits are those of the candidate with the lowest loss (the first of equal ones, strict ``<``, l. 171, 182).
* Dynamic perturbation (``forward``, l. 219-243, eq. 12): ``L`` = that lowest loss; ``avg`` = L at the first
  batch, then ``0.9 avg + 0.1 L`` (l. 107, 220-223); ``eps *= 0.9``, ``lr *= 0.7`` (l. 227-228); if
  ``L > 1.05 avg`` (the new avg, l. 108, 231): ``eps = 0.5`` (eps_max), ``lr = 0.1`` (lr_min), else
  ``lr = min(3.0, lr + 0.1)`` (l. 233-239); both clipped, eps to [0.2, 0.5], lr to [0.1, 3.0] (l. 89-91,
  109-110, 242-243). The update ``P -= lr / n_spsa * sum_j g_j Z_j`` (``zo_update``, l. 198-208) uses the
  *new* lr, so the initial ``lr`` (0.08, l. 82; ``run.sh`` too) only enters the first batch's as ``0.08 * 0.7
  + 0.1``; the initial eps (0.5) is the first batch's perturbation scale.
* Activation shift (l. 119-131, 255-257): ``shift = mu_src,last - h`` from the second batch on (no shift on the
  first), where ``h`` is an EMA (first batch: set; then ``0.9 h + 0.1 m``) of ``m`` = the *sum* of the two
  perturbation sides' last-layer batch means (each averaged over the ``n_spsa`` draws, l. 193-194, 256), i.e.
  about twice the target mean: the code's, followed (the paper's eq. reads as a mean). The shift enters both
  the reported logits and the entropy term of the loss.
* Source statistics (``obtain_origin_stat``, l. 262-302, ``main.py`` l. 87-99, 214-215): unbiased std and mean
  of those features without prompts over the whole clean ImageNet val set (Resize 256 + CenterCrop 224, the
  0.5/0.5 normalisation, ``dataset/selectedRotateImageFolder.py`` l. 18, 24-25): FOA's statistics on FOA's
  images, so `stats_key` shares FOA's cache (``--source-data``, as FOA).
* Resets (``reset``, l. 314-322): h, avg, eps and lr back to their initial values and the prompts re-drawn,
  after every corruption unless ``--continual`` (``main.py`` l. 240-245); the engine's reset per domain does the
  same and ``--setting continual`` keeps the state across domains. The official headline run is ``--continual``
  (``run.sh``) on RobustBench's 5,000 images per corruption (``main.py`` l. 147-157); here every image of the
  stream, in the harness's order.
* Protocol: batch 64 (``main.py`` l. 128), severity 5 (l. 134), timm ``vit_base_patch16_224`` (l. 204).

Choices the official code leaves open or fixes in code, settled here:

* ``eps_min``, ``eps_max``, ``eps_decay``, ``lr_min``, ``lr_max``, ``lr_step``, ``lr_decay``, ``loss_alpha`` and
  ``loss_threshold`` are constants of the class (l. 89-91, 107-111, 228), here fields with those values.
* Z is drawn from JAX's generator with the state's key (`perturbations`), where the official seeds torch with
  ``np.random.randint(1e9)`` per draw (l. 140, 163); the initial prompts are drawn once from ``seed`` (2000,
  ``main.py`` l. 124), so every domain restarts from the same prompts where the official re-draws them from
  torch's global stream at each ``reset()`` (``models/vpt.py`` l. 28-30): FOA's choice.
* avg, eps and lr are float32 scalars (the official's are Python floats).
* Padded rows of a ragged batch enter no statistic or sum, and B is the number of valid rows; a batch with one
  valid row leaves out the std term (torch's unbiased std would be NaN), as FOA here.
* The shift takes the last D entries of the feature mean (``[-768:]`` in the code, ViT-B's width, l. 131), and
  any depth runs (the code refuses fewer than 12 layers, l. 36-37, a check its halves do not need).

Not carried over: the quantised (PTQ4ViT INT8) models (``--quant``), the metrics CSV (l. 245-250), the
ImageNet-R mask. Under ``--realtime`` a batch the clock skips gets the network's plain forward (`Method.forward`:
no prompts, no shift, the source model, as FOA's), and is not adapted on; FOZO's step is 2 forwards (2F).
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
from pcsr_jax.methods.base import Method, Prepared
from pcsr_jax.methods.foa import layer_cls_stats, layer_cls_stats_shapes, masked_std_mean
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.models import vit

Array = jax.Array


@flax.struct.dataclass
class FOZOState:
  """The prompts ``[P * D]``, the shift's EMA ``h`` ``[D]``, the loss EMA and the current eps and lr."""

  prompts: Array
  hist: Array
  hist_valid: Array
  avg_loss: Array
  avg_valid: Array
  eps: Array
  lr: Array


@dataclasses.dataclass(frozen=True)
class FOZO(Method):
  name: ClassVar[str] = "fozo"
  cost: ClassVar[str] = "2F"  # 2 * n_spsa forwards, 0 backwards
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the best perturbed candidate's logits
  source_data: ClassVar[str] = "required"  # source_images None: all of them, as FOA

  num_prompts: int = field(3, ">= 1")  # main.py l. 142
  fitness_lambda: float = field(0.4, ">= 0")  # FOZO.py l. 82, main.py l. 143
  zo_eps: float = field(0.5, "> 0")  # the first perturbation scale (l. 82)
  lr: float = field(0.08, "> 0")  # the initial lr (l. 82, run.sh); decayed and raised before the first update
  n_spsa: int = field(1, ">= 1")  # draws per batch (l. 82)
  eps_min: float = field(0.2, "> 0")  # l. 109
  eps_max: float = field(0.5, "> 0")  # l. 110
  eps_decay: float = field(0.9, "(0, 1]")  # l. 111
  lr_min: float = field(0.1, ">= 0")  # l. 89
  lr_max: float = field(3.0, ">= 0")  # l. 90
  lr_step: float = field(0.1, ">= 0")  # l. 91
  lr_decay: float = field(0.7, "(0, 1]")  # l. 228
  loss_alpha: float = field(0.9, "[0, 1)")  # the loss EMA's weight on its past (l. 107)
  loss_threshold: float = field(1.05, "> 0")  # a loss above this times its EMA resets eps and lr (l. 108)
  shift: bool = True  # the activation shift (l. 60-61)
  seed: int = field(2000, ">= 0")  # the initial prompts (main.py l. 124)
  # Candidates evaluated at once (jax.lax.map batch_size). 0: all 2 n_spsa on a GPU/TPU, one at a time on a CPU.
  chunk: int = field(0, ">= 0")

  def __post_init__(self):
    super().__post_init__()
    if self.eps_min > self.eps_max:
      raise UserError(f"fozo: eps_min must be <= eps_max ({self.eps_max}), got {self.eps_min}")
    if self.lr_min > self.lr_max:
      raise UserError(f"fozo: lr_min must be <= lr_max ({self.lr_max}), got {self.lr_min}")

  def prepare(self, model, params, rng, batch_size):
    return Prepared(model, params, is_trainable=lambda path: False, tx=optax.identity())

  def initial_prompts(self, model) -> Array:
    """VPT's Xavier-uniform init of the ``[P, D]`` prompts (``models/vpt.py`` l. 25-26)."""
    return vit.vpt_prompts(model.config, self.num_prompts, self.seed)

  def init_extra(self, prep, trainable, opt_state):
    d = prep.model.config.embed_dim
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    no = jnp.zeros((), bool)
    return FOZOState(prompts=self.initial_prompts(prep.model).reshape(-1), hist=jnp.zeros(d), hist_valid=no,
                     avg_loss=f32(0.0), avg_valid=no, eps=f32(self.zo_eps), lr=f32(self.lr))

  def stats_key(self) -> str:
    return "foa"  # FOA's statistics of FOA's images (obtain_origin_stat, l. 262-302): one cache for both

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Mean and unbiased std over all source images of the per-layer class-token features, no prompts."""
    return layer_cls_stats(self.name, prep, frozen, trainable, batches)

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    return layer_cls_stats_shapes(prep, frozen, trainable)

  def perturbations(self, rng: Array, model) -> tuple[Array, Array]:
    """``(next rng, Z)``: the batch's ``n_spsa`` directions ``[n_spsa, P * D]``, standard normal (l. 143)."""
    rng, key = jax.random.split(rng)
    return rng, jax.random.normal(key, (self.n_spsa, self.num_prompts * model.config.embed_dim), jnp.float32)

  def evaluate(self, prep: Prepared, frozen: Any, images: Array, valid: Array, prompts: Array,
               shift: Array) -> tuple[Array, Array, Array]:
    """One candidate's ``(loss, shifted logits, batch mean of the last-layer feature)`` (l. 22-74).

    ``prompts`` is ``[P, D]``; ``shift`` ``[D]`` is added to the last-layer feature (zeros: no shift).
    """
    variables = {"params": frozen}
    _, cls = in_row_passes(prep, lambda x: prep.model.apply(variables, x, prompts=prompts, return_cls=True), images)
    b, depth, d = cls.shape
    std, mean = masked_std_mean(cls.reshape(b, depth * d), valid)
    n = jnp.sum(valid)
    # One valid row has no unbiased std (torch: NaN, which would poison eps, lr and the prompts): left out.
    std_term = jnp.where(n > 1, jnp.sum(jnp.square(std - prep.consts["std"])), 0.0)
    discrepancy = self.fitness_lambda * (std_term + jnp.sum(jnp.square(mean - prep.consts["mean"]))) * n / 64
    logits = prep.model.apply(variables, cls[:, -1] + shift, method=prep.model.classify)  # l. 58-64
    loss = jnp.sum(jnp.where(valid, losses.entropy(logits), 0.0)) + discrepancy  # l. 67-71
    return loss, logits, mean[-d:]

  def update(self, prep, frozen, state, images, valid):
    rng, z = self.perturbations(state.rng, prep.model)
    state, logits, metrics, _ = self.adapt(prep, frozen, state.replace(rng=rng), images, valid, z)
    return state, logits, metrics

  def adapt(self, prep: Prepared, frozen: Any, state: Any, images: Array, valid: Array,
            z: Array) -> tuple[Any, Array, dict[str, Array], Array]:
    """The step given the batch's directions ``z`` ``[n_spsa, P * D]`` (`perturbations`).

    Returns ``(state, logits, metrics, the 2 n_spsa losses in the order +, - per draw)``.
    """
    s: FOZOState = state.extra
    d = prep.model.config.embed_dim
    shift = jnp.where(s.hist_valid & self.shift, prep.consts["mean"][-d:] - s.hist, 0.0)  # l. 126-131
    # The candidates in the official order, with the in-place moves' rounding (l. 166, 177, 191).
    p, candidates = s.prompts, []
    for j in range(self.n_spsa):
      plus = p + s.eps * z[j]
      minus = plus + (-2.0 * s.eps) * z[j]
      p = minus + s.eps * z[j]
      candidates += [plus, minus]

    def one(prompts):
      return self.evaluate(prep, frozen, images, valid, prompts.reshape(self.num_prompts, d), shift)

    chunk = self.chunk or (1 if prep.platform == "cpu" else len(candidates))
    loss, logits, means = jax.lax.map(one, jnp.stack(candidates), batch_size=chunk)
    best = jnp.argmin(loss)  # the first of equal minima: the official's strict `<` (l. 171, 182)
    grad = (loss[0::2] - loss[1::2]) / (2.0 * s.eps)  # eq. 5, l. 188
    current = loss[best]
    # Eq. 12 (l. 219-243).
    avg = jnp.where(s.avg_valid, self.loss_alpha * s.avg_loss + (1.0 - self.loss_alpha) * current, current)
    increasing = current > avg * self.loss_threshold
    eps = jnp.where(increasing, self.eps_max, s.eps * self.eps_decay)
    lr = jnp.where(increasing, self.lr_min, jnp.minimum(self.lr_max, s.lr * self.lr_decay + self.lr_step))
    eps, lr = jnp.clip(eps, self.eps_min, self.eps_max), jnp.clip(lr, self.lr_min, self.lr_max)
    for j in range(self.n_spsa):  # eq. 7, l. 203-208: addcmul_(z, g, value=-lr / n)
      p = p + (-lr / self.n_spsa) * (z[j] * grad[j])
    m = jnp.mean(means[0::2], axis=0) + jnp.mean(means[1::2], axis=0)  # l. 193-194, 256: the sides' sum
    hist = jnp.where(s.hist_valid, 0.9 * s.hist + 0.1 * m, m)  # l. 119-124
    extra = FOZOState(prompts=p, hist=hist, hist_valid=jnp.ones((), bool), avg_loss=avg,
                      avg_valid=jnp.ones((), bool), eps=eps, lr=lr)
    metrics = {"loss": current, "avg_loss": avg, "eps": eps, "lr": lr, "grad": grad[0],
               "increasing": increasing.astype(jnp.int32), "best": best.astype(jnp.int32)}
    return state.replace(extra=extra, step=state.step + 1), logits[best], metrics, loss
