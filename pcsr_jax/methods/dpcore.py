"""DPCore (Zhang et al., ICML 2025): a dynamic prompt coreset for continual test-time adaptation, as in
``zybeich/DPCore`` (``imagenet/``: ``dpcore.py``, ``vpt.py``, ``conf.py``, ``cfgs/dpcore.yaml``, ``imagenetc.py``).

* Prompts: ``num_prompts`` (8) tokens inserted after the class token, after the position embedding (no
  position of their own: the model's ``prompts``), uniform in ``+-sqrt(6 / (C p^2 + D))`` (0.0625 for
  ViT-B/16). Only the prompts adapt; the backbone is frozen.
* Source statistics (``--source-data``, cached as the others): the mean and unbiased std of the final-norm
  class token of the *unprompted* model over the first ``source_kept`` (300) source images whose entropy under
  the *prompted* model (initial prompts) is below ``ln(C) / 2 - 1``. The code reads shuffled ImageNet train
  until 300 pass; here the seeded random `source_images` (1,000) of ``--source-data`` in that order, until 300
  pass (fewer than 300 passing is a one-line error).
* Loss of a batch's class-token features: ``lamb * ||std_B - std_s|| + ||mean_B - mean_s||`` (unbiased batch
  std, plain L2 norms).
* Per batch: the unprompted loss ``L0`` and statistics; if the coreset holds entries, weights ``w = softmax(-d /
  tau)`` with ``d_j = ||mean - mean_j|| + lamb ||std - std_j||`` give the prompt ``p_w = sum w_j p_j`` and its
  loss ``L1``. *Known* (``L1 < thr_rho * L0``): one step of a fresh AdamW (lr 0.1, weight decay 0.01) from
  ``p_w``, predicting with that step's forward (before the step); then every entry moves toward the batch's
  prompted statistics and the new prompt by ``ema_alpha * w_j`` (its std only grows). *New* (otherwise, and at
  an empty coreset): ``steps_new`` (50) steps of a fresh AdamW from the initial prompts, predicting with the last
  step's forward; the batch's unprompted statistics and the final prompt join the coreset. Cost 2F+1B (known;
  the code runs the step's forward again: 3F+1B) or 51F+50B to 52F+50B (new).
* Protocol: continual (``--setting continual``, ``--preset continual``: one reset, before the first domain);
  in the default setting the engine resets it per domain, as every row. Its paper reports error rates.

Departures and choices: the coreset lives in fixed arrays of ``coreset_capacity`` (1,024) entries; once full, a
new entry replaces the oldest (the code's list grows without bound; ``coreset_size`` in the metrics, and a run
whose stream could outgrow it should raise it). The code feeds its test images unnormalized ([0, 1],
robustbench's transform) while its source statistics come from normalized ones; here both are normalized with
the checkpoint's mean and std, as every row. The entropy threshold is ``ln(C) / 2 - 1`` for the model's C
classes (the code's ``ln(1000) / 2 - 1``); ``source_margin`` sets another.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Iterator, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, image_shape, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.models import vit

Array = jax.Array
PROMPTS = "dpcore_prompts"  # {"tokens": [P, D]}: the prompts the last step left


@flax.struct.dataclass
class Coreset:
  """The coreset (fixed arrays, ``count`` entries filled in order, a ring once full) and the initial prompts."""

  means: Array  # [K, D]
  stds: Array  # [K, D]
  prompts: Array  # [K, P, D]
  count: Array  # entries appended so far (min(count, K) are filled)
  initial: Array  # [P, D]


def batch_stats(features: Array, valid: Array) -> tuple[Array, Array]:
  """Mean and unbiased std over the valid rows of ``[B, D]`` features (``torch.std_mean``)."""
  v = valid.astype(features.dtype)[:, None]
  n = jnp.sum(v)
  mean = jnp.sum(features * v, axis=0) / n
  var = jnp.sum(jnp.square(features - mean) * v, axis=0) / (n - 1)
  return mean, jnp.sqrt(var)


@dataclasses.dataclass(frozen=True)
class DPCore(Method):
  name: ClassVar[str] = "dpcore"
  cost: ClassVar[str] = "2F+1B (known) / 52F+50B (new)"
  eval_orders: ClassVar[tuple[str, ...]] = ("before",)  # the forward of the branch's (last) step
  source_data: ClassVar[str] = "required"
  source_images: ClassVar[Optional[int]] = 1000  # read in a seeded order until `source_kept` pass the filter

  num_prompts: int = field(8, ">= 1")
  lr: float = field(0.1, "> 0")  # both branches' fresh AdamW
  weight_decay: float = field(0.01, ">= 0")  # torch's AdamW default, which the code keeps
  steps_new: int = field(50, ">= 1")  # E_OOD = OPTIM.STEPS
  thr_rho: float = field(0.8, "> 0")
  tau: float = field(3.0, "> 0")
  ema_alpha: float = field(0.999, "[0, 1]")
  lamb: float = field(1.0, ">= 0")  # the std term's weight, in the loss and the distances
  source_kept: int = field(300, ">= 2")  # SRC_NUM_SAMPLES
  source_margin: Optional[float] = field(None, "> 0")  # None: ln(C) / 2 - 1
  coreset_capacity: int = field(1024, ">= 1")
  seed: int = field(0, ">= 0")  # the initial prompts' draw

  def is_trainable(self, path) -> bool:
    return path[0] == PROMPTS

  def initial_prompts(self, model) -> Array:
    return vit.vpt_prompts(model.config, self.num_prompts, self.seed)  # vpt.py:22-26

  def threshold(self, num_classes: int) -> float:
    t = self.source_margin if self.source_margin is not None else math.log(num_classes) / 2 - 1
    if t <= 0:
      raise UserError(f"dpcore source_margin: ln(C) / 2 - 1 is {t:.3f} for {num_classes} classes, which keeps no "
                      f"source image; give a positive source_margin")
    return t

  def prepare(self, model, params, rng, batch_size):
    if batch_size < 2:
      raise UserError("dpcore: the batch statistics need a batch of at least 2 (an unbiased std)")
    self.threshold(model.config.num_classes)
    full = dict(params)
    full[PROMPTS] = {"tokens": self.initial_prompts(model)}
    return Prepared(model, full, is_trainable=self.is_trainable, tx=optax.set_to_zero())

  def init_extra(self, prep, trainable, opt_state):
    c, k = prep.model.config, self.coreset_capacity
    p = trainable[PROMPTS]["tokens"]
    return Coreset(means=jnp.zeros((k, c.embed_dim)), stds=jnp.zeros((k, c.embed_dim)),
                   prompts=jnp.zeros((k,) + p.shape), count=jnp.zeros((), jnp.int32), initial=p)

  def features(self, prep: Prepared, backbone: Any, images: Array, prompts: Optional[Array]) -> tuple[Array, Array]:
    """``(final-norm class token [B, D], logits)`` with ``prompts`` [P, D] after the class token (None: none)."""
    def apply(x):
      f = prep.model.apply({"params": backbone}, x, prompts=prompts, pre_logits=True)
      return f, prep.model.apply({"params": backbone}, f, method="classify")

    return in_row_passes(prep, apply, images)

  def stats_loss(self, mean: Array, std: Array, consts: dict) -> Array:
    return self.lamb * jnp.linalg.norm(std - consts["std"]) + jnp.linalg.norm(mean - consts["mean"])

  @staticmethod
  def forward(prep, frozen, trainable, images, collect=()):
    params = merge(frozen, trainable)
    prompts = params.pop(PROMPTS)["tokens"]
    return in_row_passes(prep, lambda x: prep.model.apply({"params": params}, x, prompts=prompts), images), {}

  def update(self, prep, frozen, state, images, valid):
    backbone, core = frozen, state.extra  # the prompts are the only trainable params
    tx = optax.adamw(self.lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=self.weight_decay)

    def loss_and_aux(p):
      f, logits = self.features(prep, backbone, images, p)
      mean, std = batch_stats(f, valid)
      return self.stats_loss(mean, std, prep.consts), (logits, mean, std)

    def adam_step(p, opt):
      (_, aux), g = jax.value_and_grad(loss_and_aux, has_aux=True)(p)
      updates, opt = tx.update(g, opt, p)
      return optax.apply_updates(p, updates), opt, aux

    raw_f, _ = self.features(prep, backbone, images, None)
    raw_mean, raw_std = batch_stats(raw_f, valid)
    l0 = self.stats_loss(raw_mean, raw_std, prep.consts)
    k = self.coreset_capacity
    filled = jnp.arange(k) < jnp.minimum(core.count, k)
    d = (jnp.linalg.norm(raw_mean - core.means, axis=-1) + self.lamb * jnp.linalg.norm(raw_std - core.stds, axis=-1))
    w = jax.nn.softmax(jnp.where(filled, -d / self.tau, -jnp.inf))
    w = jnp.where(filled, w, 0.0)
    p_w = jnp.sum(w[:, None, None] * core.prompts, axis=0)
    l1, _ = loss_and_aux(p_w)
    known = (core.count > 0) & (l1 < self.thr_rho * l0)

    def known_branch(_):
      p_new, _, (logits, mean_b, std_b) = adam_step(p_w, tx.init(p_w))
      a = self.ema_alpha * w[:, None]
      means = core.means + a * (mean_b - core.means)
      stds = core.stds + a * jnp.maximum(std_b - core.stds, 0.0)
      prompts = core.prompts + a[:, :, None] * (p_new - core.prompts)
      return p_new, logits, core.replace(means=means, stds=stds, prompts=prompts)

    def new_branch(_):
      def body(_, carry):
        p, opt, _ = carry
        p, opt, (logits, _, _) = adam_step(p, opt)
        return p, opt, logits

      p0 = core.initial
      logits0 = jnp.zeros((images.shape[0], prep.model.config.num_classes), jnp.float32)
      p, _, logits = jax.lax.fori_loop(0, self.steps_new, body, (p0, tx.init(p0), logits0))
      slot = core.count % k
      return p, logits, core.replace(means=core.means.at[slot].set(raw_mean), stds=core.stds.at[slot].set(raw_std),
                                     prompts=core.prompts.at[slot].set(p), count=core.count + 1)

    p, logits, core = jax.lax.cond(known, known_branch, new_branch, None)
    state = state.replace(trainable={PROMPTS: {"tokens": p}}, extra=core, step=state.step + 1)
    metrics = {"loss": l0, "loss_prompted": l1, "known": known, "coreset_size": jnp.minimum(core.count, k),
               "coreset_overflow": core.count > k}
    return state, logits, metrics

  def stats_key(self) -> str:
    return f"{self.name}-p{self.num_prompts}-seed{self.seed}-kept{self.source_kept}-margin{self.source_margin}"

  def compute_source_stats(self, prep: Prepared, frozen: Any, trainable: Any,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """``obtain_src_stat``: the unprompted class-token features of the first `source_kept` images whose prompted
    entropy (initial prompts) is below the threshold; their mean and unbiased std."""
    backbone, prompts = frozen, trainable[PROMPTS]["tokens"]
    threshold = self.threshold(prep.model.config.num_classes)

    @jax.jit
    def both(x):
      raw, _ = self.features(prep, backbone, x, None)
      _, logits = self.features(prep, backbone, x, prompts)
      return raw, losses.entropy(logits)

    kept, seen, n = [], 0, 0
    for images, _ in batches:
      raw, ent = (np.asarray(a) for a in both(images))
      seen += len(raw)
      kept.append(raw[ent < threshold])
      n += len(kept[-1])
      if n >= self.source_kept:
        break
    f = np.concatenate(kept)[:self.source_kept].astype(np.float64)
    if len(f) < self.source_kept:
      raise UserError(f"dpcore: {len(f)} of {seen} source images have an entropy below {threshold:.3f}; its "
                      f"statistics need {self.source_kept} (pass more --source-data, or set source_kept or "
                      f"source_margin)")
    return {"mean": f.mean(0).astype(np.float32), "std": f.std(0, ddof=1).astype(np.float32)}

  def source_stats_shapes(self, prep: Prepared, frozen: Any, trainable: Any) -> dict[str, jax.ShapeDtypeStruct]:
    d = jax.eval_shape(lambda x: self.features(prep, frozen, x, None)[0], image_shape(prep.model)).shape[-1]
    return {k: jax.ShapeDtypeStruct((d,), np.float32) for k in ("mean", "std")}
