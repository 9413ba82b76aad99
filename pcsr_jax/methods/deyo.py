"""DeYO (Lee et al., ICLR 2024): Destroy Your Object, as its official code runs it on ViTs.

``Jhyun17/DeYO:methods/deyo.py`` (``forward_and_adapt_deyo``, ``collect_params``), ``main.py``, ``config.py``:

* Adapted: the LayerNorm affine params of blocks 0-8 (SAR's filter: blocks 9-11 and the final norm are
  skipped). SGD(lr = 0.001 * B / 64, momentum 0.9), the lr doubled at batch size 1 (``exp_type == 'bs1'``).
* Filter 1: entropy < tau_Ent = ``ent_factor`` * ln C (0.5 ln 1000), strict.
* x': every image cut into a ``patch_len`` x ``patch_len`` grid (4 x 4), the patches permuted independently
  per sample (``argsort`` of uniform noise, as the official ``torch.argsort(torch.rand(b, 16))``) and
  reassembled; the normalized image is permuted, as in the official code. x' is forwarded without gradient.
* PLPD = p(yhat|x) - p(yhat|x') with yhat the argmax of the original softmax; filter 2 keeps PLPD >
  ``plpd_threshold`` (0.2) among filter 1's samples.
* Loss: mean over the kept samples of ``coeff * entropy``, ``coeff = exp(-(ent - E0)) + exp(PLPD)``
  detached, E0 = ``margin_factor`` * ln C (0.4 ln 1000).
* No step when nothing is kept: the official code returns before ``optimizer.step()``, so the params and
  the momentum do not move. Here the whole update is gated with ``jnp.where`` (a zero-gradient SGD step
  would still move the params by the momentum).
* The reported prediction is the first forward's (before the update).

Differences in form, not in result: x' of filter 1's samples only is forwarded, as in the official code,
gathered into chunks of one fixed size (`pcsr_jax.methods.rows.kept_row_chunks`; a ViT treats samples
independently, so the numbers are the same). The official code resizes an image whose width is not a
multiple of ``patch_len`` to one and back (bilinear); that resize is not reproduced: such an image size is
refused (224 and the test models' 32 are multiples of 4). The patch permutations come from the state's key,
split at every step, so a run is reproducible and resumes exactly; the official code draws them from
torch's global RNG.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import Method, Prepared, is_block_layernorm_param
from pcsr_jax.methods.hyperparameters import field
from pcsr_jax.methods.optimizers import sar_code_lr, sgd
from pcsr_jax.methods.rows import kept_row_chunks, shard_rows

Array = jax.Array


def patch_permutations(key: Array, batch_size: int, patch_len: int = 4) -> Array:
  """One random permutation of the ``patch_len**2`` patches per sample, ``[B, patch_len**2]`` int32."""
  return jnp.argsort(jax.random.uniform(key, (batch_size, patch_len * patch_len)), axis=-1).astype(jnp.int32)


def shuffle_patches(images: Array, perms: Array, patch_len: int = 4) -> Array:
  """Images ``[B, H, W, C]`` with their grid of ``patch_len`` x ``patch_len`` patches permuted per sample.

  Patches are numbered row-major (einops' ``(ps1 ps2)`` in the official code); output patch ``j`` of sample
  ``b`` is input patch ``perms[b, j]``.
  """
  b, h, w, c = images.shape
  n = patch_len
  grid = images.reshape(b, n, h // n, n, w // n, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, n * n, h // n, w // n, c)
  grid = jnp.take_along_axis(grid, perms[:, :, None, None, None], axis=1)
  return grid.reshape(b, n, n, h // n, w // n, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


@dataclasses.dataclass(frozen=True)
class DeYO(Method):
  name: ClassVar[str] = "deyo"
  cost: ClassVar[str] = "1F (+1F+1B on the kept rows)"
  lr: Optional[float] = field(None, "> 0")  # None: 0.001 * B / 64, doubled at B = 1
  momentum: float = field(0.9, "[0, 1)")
  # filter 1: entropy < ent_factor * ln C (margin_factor = 0.4 is the reweighting E0)
  ent_factor: float = field(0.5, ">= 0")
  plpd_threshold: float = field(0.2, "[-1, 1]")  # PLPD is a difference of two probabilities
  patch_len: int = field(4, ">= 1")
  skip_blocks: tuple[int, ...] = field((9, 10, 11), ">= 0")
  # x' is forwarded in chunks of ceil(B / shuffle_chunks) rows (filter 1's rows only)
  shuffle_chunks: int = field(4, ">= 1")

  def trainable(self, path) -> bool:
    return is_block_layernorm_param(path, self.skip_blocks)

  def prepare(self, model, params, rng, batch_size):
    if model.config.img_size % self.patch_len:
      raise UserError(f"deyo patch_len: expected a divisor of the image size {model.config.img_size}, "
                      f"got {self.patch_len}")
    lr = self.lr if self.lr is not None else sar_code_lr(batch_size) * (2 if batch_size == 1 else 1)
    return Prepared(model, params, is_trainable=self.trainable, tx=sgd(lr, self.momentum))

  def step_permutations(self, rng: Array, batch_size: int) -> tuple[Array, Array]:
    """``(next rng, this step's patch permutations)`` from the state's key (one split per step)."""
    rng, key = jax.random.split(rng)
    return rng, patch_permutations(key, batch_size, self.patch_len)

  def update(self, prep, frozen, state, images, valid):
    num_classes = prep.model.config.num_classes
    tau_ent = losses.entropy_margin(num_classes, self.ent_factor)
    e0 = self.margin(num_classes)
    rng, perms = self.step_permutations(state.rng, images.shape[0])
    logits, pullback = jax.vjp(lambda t: self.forward(prep, frozen, t, images)[0], state.trainable)
    ent = losses.entropy(logits)
    mask1 = losses.reliable_mask(ent, tau_ent, valid)
    prob = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    yhat = jnp.argmax(prob, axis=-1)[:, None]

    # As the official code, x' of filter 1's samples only goes through the model (`kept_row_chunks`): in
    # chunks of ceil(B / shuffle_chunks) rows, none when filter 1 keeps nothing (the official returns there).
    kept_rows = kept_row_chunks(prep, mask1, self.shuffle_chunks)

    def plpd_chunk(i, plpd):
      rows, kept = kept_rows.chunk(i)
      shuffled = shard_rows(prep, shuffle_patches(images[rows], perms[rows], self.patch_len))
      logits_prime, _ = self.forward(prep, frozen, state.trainable, shuffled)
      prob_prime = jax.nn.softmax(logits_prime.astype(jnp.float32), axis=-1)
      gap = (jnp.take_along_axis(prob[rows], yhat[rows], -1) - jnp.take_along_axis(prob_prime, yhat[rows], -1))[:, 0]
      return plpd.at[rows].add(jnp.where(kept, gap, 0.0))  # each kept row once; padding adds 0

    plpd = jax.lax.fori_loop(0, kept_rows.num_chunks, plpd_chunk, jnp.zeros_like(ent))
    # The official returns after the PLPD filter when it keeps nothing (no backward, no optimizer.step()).
    mask2 = mask1 & (plpd > self.plpd_threshold)
    coeff = jnp.exp(-(ent - e0)) + jnp.exp(plpd)
    loss, dlogits = jax.value_and_grad(lambda lg: losses.masked_mean(coeff * losses.entropy(lg), mask2))(logits)
    state = self.apply_gradients_if(prep, state, jnp.any(mask2), lambda: pullback(dlogits)[0])
    state = state.replace(step=state.step + 1, rng=rng)
    metrics = {"loss": loss, "num_reliable": jnp.sum(mask1), "num_reliable2": jnp.sum(mask2)}
    return state, logits, metrics
