"""REM (Han et al., ICML 2025): ranked entropy minimization over masked views, as in ``pilsHan/rem``
(``imagenet/rem.py``, ``imagenet/robustbench/model_zoo/rem_vit.py``, ``imagenet/imagenetc.py``,
``cfgs/vit/rem.yaml``).

* Views: the full forward (which also gives the last block's attention: the heads' mean of the class token's
  softmax row, over the patches), then ``num_views - 1`` forwards that keep only the ``int(N (1 - r))``
  lowest-attended patch tokens for the ratios ``r = i * mask_ratio`` (0.1, 0.2: 176 and 156 of ViT-B's 196;
  the most attended are dropped), gathered after the position embedding with the class token kept
  (the model's ``keep``). All views carry gradient.
* Loss = MCL + ``lamb`` (1) x ERL. MCL: for every more-masked view ``i`` and every less-masked ``j < i``, the
  batch mean of the cross-entropy of view ``i``'s softmax against view ``j``'s detached softmax. ERL: for every
  ``i < j``, the batch mean of ``relu(H_i - sg(H_j) + margin)`` (margin 0 x ln C): a less-masked view should
  not be less certain than a more-masked one.
* Adapted: the LayerNorms of blocks 0-8 (the code's ``blocks.9``-``blocks.11`` name test), by Adam (lr 1e-3,
  betas 0.9 / 0.999, no weight decay; not scaled with the batch size).
* Prediction: the full forward, before the update (3F + 1B: one backward through the three forwards).
* No reset inside a stream: its protocol is the continual one (``--setting continual``: the 15 corruptions in
  a row, reset once at the start); under the default setting the engine resets per domain as for every row.

Departures and choices: the code's batch is 50, here the harness's (64, as every row). The code feeds
unnormalized [0, 1] images to its ViT (robustbench's transform); here, as for every row, the checkpoint's
normalization. Its margin is ``MARGIN * ln 1000``; here ``margin * ln C``. Its full forward runs in train
mode and the views in eval mode: the same values for a ViT without dropout. Near-equal attention weights are
ordered by ``argsort`` here and by ``topk`` there (a tie picks either patch; the random tests have none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import SAR_SKIP_BLOCKS, Method, Prepared, is_block_layernorm_param, merge
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.rows import in_row_passes

Array = jax.Array


def soft_cross_entropy(logits: Array, target: Array) -> Array:
  """Per-row ``-sum softmax(target) * log_softmax(logits)``, the target detached."""
  p = jax.nn.softmax(jax.lax.stop_gradient(target), axis=-1)
  return -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class REM(Method):
  name: ClassVar[str] = "rem"
  cost: ClassVar[str] = "3F+1B"
  lr: float = field(1e-3, "> 0")
  mask_ratio: float = field(0.1, "[0, 1)")  # view i keeps int(N * (1 - i * mask_ratio)) patches
  num_views: int = field(3, ">= 2")
  lamb: float = field(1.0, ">= 0")  # ERL's weight
  margin: float = field(0.0, ">= 0")  # ERL's margin, x ln C
  skip_blocks: tuple[int, ...] = field(SAR_SKIP_BLOCKS, ">= 0")

  def __post_init__(self):
    super().__post_init__()
    if (self.num_views - 1) * self.mask_ratio >= 1:
      raise UserError(f"rem mask_ratio, num_views: view {self.num_views - 1} would keep no patch "
                      f"({self.num_views - 1} x {self.mask_ratio} >= 1)")

  def trainable(self, path) -> bool:
    return is_block_layernorm_param(path, self.skip_blocks)

  def kept_counts(self, num_patches: int) -> list[int]:
    """The patches each masked view keeps (``rem.py:88``: ``int(tokens * (1 - m))`` with ``m = i * mask_ratio``
    as the code's float arithmetic computes it)."""
    return [int(num_patches * (1 - i * self.mask_ratio)) for i in range(1, self.num_views)]

  def prepare(self, model, params, rng, batch_size):
    if min(self.kept_counts(model.config.num_patches)) < 1:
      raise UserError(f"rem mask_ratio: the model's {model.config.num_patches} patches leave a view without any")
    tx = optax.adam(self.lr, b1=0.9, b2=0.999, eps=1e-8)
    return Prepared(model, params, is_trainable=self.trainable, tx=tx)

  def loss(self, prep: Prepared, frozen, trainable, images: Array, valid: Array):
    """``(MCL + lamb * ERL, (full-forward logits, MCL, ERL, the views' kept patches))``."""
    params = merge(frozen, trainable)
    model = prep.model
    logits, weights = in_row_passes(prep, lambda x: model.apply({"params": params}, x, cls_attention=True), images)
    order = jnp.argsort(jax.lax.stop_gradient(weights[:, 1:]), axis=-1)  # ascending: least attended first
    kept = [order[:, :k] for k in self.kept_counts(model.config.num_patches)]
    apply = lambda xs: model.apply({"params": params}, xs[0], keep=xs[1])
    outs = [logits] + [in_row_passes(prep, apply, (images, k)) for k in kept]
    mean = lambda v: losses.masked_mean(v, valid)
    mcl = sum(mean(soft_cross_entropy(outs[i], outs[j])) for i in range(1, len(outs)) for j in range(i))
    ents = [losses.entropy(o) for o in outs]
    margin = self.margin * math.log(prep.model.config.num_classes)
    erl = sum(mean(jax.nn.relu(ents[i] - jax.lax.stop_gradient(ents[j]) + margin))
              for i in range(len(outs)) for j in range(i + 1, len(outs)))
    return mcl + self.lamb * erl, (logits, mcl, erl, kept)

  def update(self, prep, frozen, state, images, valid):
    (loss, (logits, mcl, erl, _)), grads = jax.value_and_grad(self.loss, argnums=2, has_aux=True)(
        prep, frozen, state.trainable, images, valid)
    state = self.apply_gradients(prep, state, grads).replace(step=state.step + 1)
    return state, logits, {"loss": loss, "mcl": mcl, "erl": erl}
