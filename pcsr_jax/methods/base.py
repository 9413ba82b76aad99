"""The interface every online TTA method implements, and the state it carries.

A method is a frozen dataclass of hyperparameters, each declared with the values it accepts (`field`: a
range, the allowed strings; checked when the method is built, `tests/test_hyperparameters.py` walks them all),
with three jobs:

* `Method.prepare` says *what* adapts: it may add modules to the model (PCSR
  adds its recalibrators), returns the full params, a predicate over parameter
  paths that marks the trainable ones, and the optax transformation.
* `Method.init_extra` gives the method's own state (`AdaptState.extra`, e.g.
  SAR's `Recovery`), carried, donated, checkpointed and resumed like the rest.
* `Method.update` says *how*: a pure function of the frozen params, the state
  and a batch (with a validity mask for padding) that returns the new state,
  the logits of the forward that computed the loss (the "before the update"
  prediction), and a dict of scalar metrics. It runs inside ``jax.jit``.

Everything else -- jit, donation, padding of ragged batches, sharding, the
eval order, resets between domains -- is the engine's (`pcsr_jax.engine`).
Adding a method (EATA, DeYO, ROID) means one new file that subclasses `Method`,
registered under a name (`pcsr_jax.methods.register`, or a line in its ``REGISTRY``).

Beside this interface: the state it carries and what `prepare` returns (`state`), its hyperparameter fields
(`hyperparameters`), the row passes every forward goes through (`rows`), and the official codes' optimizers,
SAM and SAR's recovery (`optimizers`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.methods.hyperparameters import check_hyperparameters, field
from pcsr_jax.methods.rows import in_row_passes
from pcsr_jax.methods.state import AdaptState, Prepared

Array = jax.Array
Params = Any
Path = tuple[str, ...]


def image_shape(model: nn.Module, batch: int = 1) -> jax.ShapeDtypeStruct:
  """A batch of normalized NHWC float32 images for ``model``, as a shape (for `jax.eval_shape`)."""
  c = model.config
  return jax.ShapeDtypeStruct((batch, c.img_size, c.img_size, c.in_chans), jnp.float32)


def split(params: Params, is_trainable: Callable[[Path], bool]) -> tuple[Params, Params]:
  """Splits a param tree into ``(frozen, trainable)`` nested dicts by path."""
  flat = traverse_util.flatten_dict(params)
  frozen = {k: v for k, v in flat.items() if not is_trainable(k)}
  trainable = {k: v for k, v in flat.items() if is_trainable(k)}
  return traverse_util.unflatten_dict(frozen), traverse_util.unflatten_dict(trainable)


def merge(frozen: Params, trainable: Params) -> Params:
  """Inverse of `split`."""
  flat = traverse_util.flatten_dict(frozen)
  flat.update(traverse_util.flatten_dict(trainable))
  return traverse_util.unflatten_dict(flat)


def require_head(method: str, model: nn.Module, params: Params) -> None:
  """A one-line error unless the model has a linear classification head (the methods that read or replace it:
  T3A's prototypes, NEO's re-centred head, PEA's)."""
  if model.config.num_classes == 0 or "head" not in params:
    raise UserError(f"{method}: the model needs a linear classification head (num_classes > 0)")


def is_layernorm_param(path: Path) -> bool:
  """LayerNorm scale/bias: ``blocks_i/norm1``, ``blocks_i/norm2`` and the final ``norm``."""
  return len(path) >= 2 and path[-2] in ("norm1", "norm2", "norm") and path[-1] in ("scale", "bias")


# The blocks whose LayerNorms the official codes' ``collect_params`` leave frozen. Their test is on module
# names: skip a module whose name contains 'blocks.9', 'blocks.10', ... as a substring (and the final 'norm').
# A block's LayerNorm is 'blocks.<i>.norm1', so 'blocks.<k>' hits block i iff str(i) starts with str(k):
# 'blocks.9' misses 'blocks.19', 'blocks.21' misses 'blocks.2'. Below 90 blocks (`models.configs`' deepest, ViT-H,
# has 32) the test hits exactly these block numbers, at every depth (ViT-B's 12 blocks have no 21-23).
SAR_SKIP_BLOCKS = (9, 10, 11)  # mr-eggplant/SAR sar.py: 'blocks.9', 'blocks.10', 'blocks.11'
AUTHORS_SKIP_BLOCKS = (9, 10, 11, 21, 22, 23)  # DCT's and DPAL's dct.py, dpal.py (and their sar.py): + 21-23


def is_block_layernorm_param(path: Path, skip_blocks: tuple[int, ...]) -> bool:
  """The LayerNorms of the blocks not in ``skip_blocks`` (never the final norm): SAR's, DeYO's and `pcsr`'s
  adapted backbone params (`SAR_SKIP_BLOCKS`, `AUTHORS_SKIP_BLOCKS`)."""
  if not is_layernorm_param(path) or path[0] == "norm":
    return False
  return not (path[0].startswith("blocks_") and int(path[0].split("_")[1]) in skip_blocks)


@dataclasses.dataclass(frozen=True)
class Method(abc.ABC):
  """Base class of online TTA methods. Subclasses are frozen dataclasses of hyperparameters."""

  name: ClassVar[str]
  default_eval_order: ClassVar[str] = "before"  # SAR's code reports the loss forward's prediction
  # "perturbed": the logits of a SAM method's second forward (at the perturbed weights), which `update`
  # returns in its metrics as ``perturbed_logits`` (DPAL's reported prediction).
  eval_orders: ClassVar[tuple[str, ...]] = ("before", "after")

  # Forward (F) and backward (B) passes of the backbone per batch, as the official code runs them.
  cost: ClassVar[str] = "1F+1B"

  # Reliability threshold E0 = margin_factor * ln(C) (0.4 ln 1000 for ImageNet; 0: no sample is reliable).
  margin_factor: float = field(0.4, ">= 0")

  # Clean source data (`pcsr_jax.source_stats`): "none"; "required" (CFA, FOA: no source-free form);
  # "optional" (EATA: without it, its documented source-free form ETA runs, and the records say so).
  source_data: ClassVar[str] = "none"
  # How many source images the statistics use (None: all of them, or --source-images) and whether they need
  # the labels; `stats_key` names the statistics in the cache.
  source_images: ClassVar[Optional[int]] = None
  source_labels: ClassVar[bool] = False

  def __post_init__(self):
    """Checks the hyperparameters (`check_hyperparameters`). A subclass with rules that tie its own fields
    together checks them in its ``__post_init__``, after calling this one."""
    check_hyperparameters(self)

  @abc.abstractmethod
  def prepare(self, model: nn.Module, params: Params, rng: Array, batch_size: int) -> Prepared:
    """Model, full params, trainable predicate and optimizer for a stream of ``batch_size`` batches."""

  @abc.abstractmethod
  def update(self, prep: Prepared, frozen: Params, state: AdaptState, images: Array,
             valid: Array) -> tuple[AdaptState, Array, dict[str, Array]]:
    """One online step: ``(state, logits_of_the_loss_forward, metrics)``."""

  def uses_source_data(self) -> bool:
    """Whether this instance needs statistics of clean source data (a hyperparameter may turn it off)."""
    return self.source_data != "none"

  def check_inputs(self, model: nn.Module, params: Params, batch_size: int) -> None:
    """One-line `UserError` if a file the method reads (DePT-G's trained prompts, DDA's UNet) is missing, damaged
    or does not fit ``model``/``params`` at ``batch_size``: called by the harness for every method of a run once
    the checkpoint is loaded, before any work, so that no method's input is found wrong after another method
    ran. `prepare` runs the same checks. Nothing to check by default."""

  def source_free(self) -> Optional["Method"]:
    """The documented form this method runs without source data (EATA -> ETA), or None if it has none."""
    return None

  def source_free_note(self) -> str:
    """How `source_free` differs from this method, for logs and records (e.g. "ETA: fisher_alpha 0")."""
    return ""

  def stats_key(self) -> str:
    """What the statistics depend on besides checkpoint and data (name + relevant hyperparameters)."""
    return self.name

  def compute_source_stats(self, prep: Prepared, frozen: Params, trainable: Params,
                           batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Statistics of clean source data, computed once before adaptation and cached with the checkpoint.

    ``batches`` yields ``(images, labels)``: normalized NHWC float32 images and int labels (-1 where the
    source has none), ``source_images`` of them in all (all when None). Returns a flat dict of arrays,
    which `Adapter` puts in ``prep.consts``.
    """
    raise NotImplementedError(f"{self.name} uses no source statistics")

  def source_stats_shapes(self, prep: Prepared, frozen: Params, trainable: Params) -> dict[str, jax.ShapeDtypeStruct]:
    """The keys, shapes and dtypes `compute_source_stats` returns for this model, without computing them
    (`image_shape` and `jax.eval_shape` help). A cached copy is checked against them before use
    (`pcsr_jax.source_stats`): a cache whose arrays were forged or mixed up is rebuilt, not broadcast."""
    raise NotImplementedError(f"{self.name} uses no source statistics")

  def init_extra(self, prep: Prepared, trainable: Params, opt_state: Any) -> Any:
    """The method's own state at the start of a stream (a pytree, or None): see `AdaptState.extra`."""
    return None

  def extra_after_reset(self, fresh: Any, previous: Any) -> Any:
    """The method's own state at a reset between domains (`engine.Adapter.reset`), from ``fresh`` (`init_extra`'s)
    and ``previous`` (the last domain's): ``fresh``, unless the official ``reset()`` keeps part of it (CMF)."""
    return fresh

  def margin(self, num_classes: int) -> float:
    return losses.entropy_margin(num_classes, self.margin_factor)

  @staticmethod
  def forward(prep: Prepared, frozen: Params, trainable: Params, images: Array,
              collect: tuple[str, ...] = ()) -> tuple[Array, dict]:
    """Logits, plus the sown collections named in ``collect`` (e.g. PCSR's 'losses').

    With ``prep.row_chunk`` set and dividing the batch (and divided by the mesh's devices), the batch goes
    through the model in passes of ``row_chunk`` rows, one after the other (`in_row_passes`; their backward
    passes in reverse): the same logits up to float32 rounding of the weight gradients' sums, with each pass's
    activations small enough to stay in a CPU's caches (at batch 64 on 2 CPU cores, passes of 16 rows run
    Source's and TENT's steps 1.3x faster). The model's rows are independent (no batch statistics), so only
    the order of the work changes. Sown values must be per row (PCSR's per-sample similarity); any other runs
    in one pass. ``row_chunk`` must also split over the mesh's devices, or each pass would run unsharded.
    """
    variables = {"params": merge(frozen, trainable)}

    def apply(x):
      if collect:
        return prep.model.apply(variables, x, mutable=list(collect))
      return prep.model.apply(variables, x), {}

    return in_row_passes(prep, apply, images)

  @staticmethod
  def apply_gradients(prep: Prepared, state: AdaptState, grads: Params) -> AdaptState:
    updates, opt_state = prep.tx.update(grads, state.opt_state, state.trainable)
    return state.replace(trainable=optax.apply_updates(state.trainable, updates), opt_state=opt_state)

  @classmethod
  def apply_gradients_if(cls, prep: Prepared, state: AdaptState, pred: Array,
                         grads: Callable[[], Params]) -> AdaptState:
    """`apply_gradients` with ``grads()`` when ``pred``, else ``state`` unchanged (params and optimizer state).

    Under ``lax.cond``: a batch on which the method's filters keep nothing skips the backward pass (``grads``
    is traced into the taken branch only), as the official codes return before ``loss.backward()``. Build
    ``grads`` from a ``jax.vjp`` pullback of the forward already computed, so the kept case costs no extra
    forward."""
    def step(_):
      new = cls.apply_gradients(prep, state, grads())
      return new.trainable, new.opt_state

    trainable, opt_state = jax.lax.cond(pred, step, lambda _: (state.trainable, state.opt_state), None)
    return state.replace(trainable=trainable, opt_state=opt_state)
