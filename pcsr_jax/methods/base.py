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
Adding a method (EATA, DeYO, ROID) means one new file that subclasses `Method`
and registers itself in `pcsr_jax.methods`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import re
import typing
from typing import Any, Callable, ClassVar, Iterator, Mapping, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from pcsr_jax import losses
from pcsr_jax.errors import UserError
from pcsr_jax.models import vit

Array = jax.Array
Params = Any
Path = tuple[str, ...]


@flax.struct.dataclass
class AdaptState:
  """Everything that changes along a stream (a pytree; donated to every step).

  ``extra`` is the method's own state (`Method.init_extra`): any pytree, which
  the engine carries, donates and places, and the harness checkpoints and
  resumes with the rest (SAR's `Recovery`; ``None`` for methods without one).
  ``resets`` counts in-step recoveries, reported per domain in the records.
  """

  trainable: Params
  opt_state: Any
  step: Array
  rng: Array
  resets: Array
  extra: Any = None


@flax.struct.dataclass
class Recovery:
  """SAR's model recovery state: the EMA of the second-pass loss (``valid`` False = PyTorch's ``None``) and
  the trainable params and optimizer state a reset returns to."""

  ema: Array
  valid: Array
  source: Any

  @staticmethod
  def init(trainable: Params, opt_state: Any) -> "Recovery":
    return Recovery(ema=jnp.zeros((), jnp.float32), valid=jnp.zeros((), bool), source=(trainable, opt_state))


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `Method.prepare` returns."""

  model: nn.Module
  params: Params
  is_trainable: Callable[[Path], bool]
  tx: optax.GradientTransformation
  parts: Mapping[str, optax.GradientTransformation] = dataclasses.field(default_factory=dict)  # of a `parallel` tx
  # Read-only arrays the step needs besides the params: the method's source statistics (EATA's Fisher, CFA's
  # moments, FOA's feature mean/std). The engine places them on the device and passes them to the compiled
  # step as an argument (inside `Method.update` they are traced values, never constants baked into the program).
  consts: Any = None
  # The engine's device mesh (a 1-D ``'data'`` mesh), set while it traces the step; None outside the engine.
  # A method that gathers a dynamic subset of the batch (`kept_row_chunks`) shards the subset over it.
  mesh: Optional[jax.sharding.Mesh] = None
  # Rows per pass of `Method.forward` (the engine's ``row_chunk``): None runs a batch as one pass.
  row_chunk: Optional[int] = None


class KeptRows(NamedTuple):
  """The kept rows of a batch in chunks of one fixed ``size`` (`kept_row_chunks`): ``order`` lists the batch's
  row indices, kept rows first in batch order (padded to a whole number of chunks), ``count`` is how many are
  kept and ``num_chunks`` how many chunks hold them."""

  order: Array
  count: Array
  num_chunks: Array
  size: int

  def chunk(self, i: Array) -> tuple[Array, Array]:
    """``(rows, kept)`` of chunk ``i``: its ``size`` row indices and which of them are kept rows (the
    positions past ``count`` are dropped rows or padding, and may repeat a row)."""
    rows = jax.lax.dynamic_slice(self.order, (i * self.size,), (self.size,))
    return rows, i * self.size + jnp.arange(self.size) < self.count


def kept_row_chunks(prep: Prepared, keep: Array, chunks: int) -> KeptRows:
  """The rows where ``keep`` is True, cut into chunks of ``ceil(B / chunks)`` rows rounded up to a multiple
  of the mesh's devices, so a chunk shards evenly (`shard_rows`).

  A method whose official code runs a pass on the kept samples only (ROID's ``imgs_test[~mask]``) loops
  over chunks ``0 .. num_chunks - 1`` (`KeptRows.chunk`): it pays for what it keeps, within one chunk, and
  compiles one pass of one shape.
  """
  b = keep.shape[0]
  n_dev = prep.mesh.devices.size if prep.mesh is not None else 1
  size = math.ceil(math.ceil(b / chunks) / n_dev) * n_dev
  total = math.ceil(b / size) * size
  order = jnp.argsort(~keep, stable=True).astype(jnp.int32)
  order = jnp.concatenate([order, jnp.zeros((total - b,), jnp.int32)])
  count = jnp.sum(keep.astype(jnp.int32))
  return KeptRows(order, count, (count + size - 1) // size, size)


def shard_rows(prep: Prepared, x: Array) -> Array:
  """``x`` with its leading (batch) axis sharded over the engine's mesh; unchanged outside the engine, or
  where that axis does not split evenly over the mesh's devices."""
  if prep.mesh is None or x.shape[0] % prep.mesh.devices.size:
    return x
  batch = jax.sharding.NamedSharding(prep.mesh, jax.sharding.PartitionSpec("data"))
  return jax.lax.with_sharding_constraint(x, batch)


def splits_into_passes(batch: int, row_chunk: Optional[int], devices: int) -> bool:
  """Whether `in_row_passes` runs a batch of ``batch`` rows in passes of ``row_chunk``: the chunk must be below
  and divide the batch, and split over the mesh's ``devices``; any other setting runs as one pass."""
  return bool(row_chunk) and row_chunk < batch and batch % row_chunk == 0 and row_chunk % devices == 0


def in_row_passes(prep: Prepared, fn: Callable[[Array], Any], images: Array) -> Any:
  """``fn(images)`` computed in passes of ``prep.row_chunk`` rows, one after the other (and their backward passes
  in reverse), when the chunk divides the batch and splits over the mesh's devices; else in one pass.

  Every forward of the model in a step goes through here (`Method.forward`, `features_and_logits`, and the
  other methods that read more than the logits: SPA, T3A, FOA), so ``--row-chunk`` holds for the whole step
  (`tests/test_engine.py` lowers every method's step to check it). ``fn`` must treat rows independently (a
  ViT does: no batch statistics); if any of its outputs is not per row (leading axis = the pass's rows, e.g.
  a sown batch statistic), the batch runs in one pass (the passes: dead code).
  """
  b, r = images.shape[0], prep.row_chunk
  n_dev = prep.mesh.devices.size if prep.mesh is not None else 1
  if not splits_into_passes(b, r, n_dev):
    return fn(images)
  n = b // r
  # Pass i takes rows i, i + n, i + 2n, ...: each device's rows (a contiguous block) feed every pass evenly.
  passes = images.reshape((r, n) + images.shape[1:]).swapaxes(0, 1)
  # Unrolled, not a `lax.map`: a loop stacks every pass's residuals into one buffer for the backward pass and
  # slices them out again, copies that took a fifth of TENT's non-matmul time at ViT-S/16 batch 64 (`python -m
  # benchmarks.profile_step --arch vit_small_patch16_224 --batch-size 64 --method tent --row-chunk 16`).
  # Unrolled, each pass keeps its own buffers: TENT's step there ran 6% faster (4 alternating runs of each), SAR's
  # 14% (one run of each); their compiles took a third to a half longer (each pass is compiled on its own).
  outs = [fn(shard_rows(prep, passes[i])) for i in range(n)]
  out = jax.tree.map(lambda *v: jnp.stack(v), *outs)
  if any(v.ndim < 2 or v.shape[1] != r for v in jax.tree.leaves(out)):
    return fn(images)
  return jax.tree.map(lambda v: v.swapaxes(0, 1).reshape((b,) + v.shape[2:]), out)


def features_and_logits(prep: Prepared, params: Params, images: Array) -> tuple[Array, Array]:
  """``(feature, logits)`` as `models.vit.features_and_logits` (the head's input and the logits from it), the
  model run in passes of ``prep.row_chunk`` rows (`in_row_passes`): CFA and AdaContrast read both."""
  return in_row_passes(prep, lambda x: vit.features_and_logits(prep.model, params, x), images)


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


def sgd(lr: float, momentum: float) -> optax.GradientTransformation:
  """PyTorch's SGD (dampening 0, no Nesterov, no weight decay): buf = m*buf + g; p -= lr*buf."""
  return optax.sgd(lr, momentum=momentum if momentum else None)


def tree_where(cond: Array, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def group_sgd(lrs: Mapping[str, float], momentum: float, label: Callable[[Path], str],
              groups: tuple[str, ...]) -> optax.GradientTransformation:
  """PyTorch SGD with one learning rate per parameter group, over a tree that holds every group.

  ``label(path)`` names a parameter's group; groups in ``groups`` but not in ``lrs`` get a zero update
  and carry no optimizer state (they belong to another optimizer of the same method).
  """
  labels = lambda tree: jax.tree_util.tree_map_with_path(lambda kp, _: label(tuple(k.key for k in kp)), tree)
  return optax.multi_transform({g: sgd(lrs[g], momentum) if g in lrs else optax.set_to_zero() for g in groups},
                               labels)


def parallel(**txs: optax.GradientTransformation) -> optax.GradientTransformation:
  """Several optimizers over one param tree, each with its own state: ``{name: state}``.

  This is the shape of PyTorch code that holds two optimizers (DPAL's SAM and its plain SGD): a method steps
  the parts separately (`Prepared.parts`); ``update`` steps them all with the same gradients.
  """

  def init(params):
    return {k: tx.init(params) for k, tx in txs.items()}

  def update(grads, state, params=None):
    total, new = None, {}
    for k, tx in txs.items():
      u, new[k] = tx.update(grads, state[k], params)
      total = u if total is None else jax.tree.map(jnp.add, total, u)
    return total, new

  return optax.GradientTransformation(init, update)


RESET_OPTIMIZER = ("official", "all")


def recover(old: AdaptState, new: AdaptState, loss: Array, has_loss: Array, decay: float = 0.9,
            threshold: float = 0.2, clear_ema: bool = False, opt_on_reset: Any = None) -> tuple[AdaptState, Array]:
  """SAR's model recovery on the state after an update; returns ``(state, reset)``.

  ``ema = decay * ema + (1 - decay) * loss`` (the first loss initializes it; a
  batch without a loss, ``has_loss`` False, leaves it alone). If ``ema <
  threshold`` the trainable params go back to ``old.extra.source[0]`` (a
  `Recovery`) and the optimizer state to ``opt_on_reset``: by default ``old.extra.source[1]``, the
  initial state ("clear everything"). The official code restores only what its
  ``optimizer.load_state_dict`` calls restore: a method passes the state that
  results (for SAM, ``new.opt_state`` itself: the momentum lives in SAM's inner
  SGD, whose state SAM's ``state_dict`` does not hold). ``clear_ema`` forgets
  the EMA on a reset.
  """
  rec = old.extra
  ema = jnp.where(rec.valid, decay * rec.ema + (1 - decay) * loss, loss)
  ema = jnp.where(has_loss, ema, rec.ema)
  valid = rec.valid | has_loss
  reset = valid & (ema < threshold)
  if clear_ema:
    valid = valid & ~reset
  opt_on_reset = rec.source[1] if opt_on_reset is None else opt_on_reset
  state = new.replace(trainable=tree_where(reset, rec.source[0], new.trainable),
                      opt_state=tree_where(reset, opt_on_reset, new.opt_state),
                      extra=rec.replace(ema=ema, valid=valid), resets=old.resets + reset.astype(jnp.int32))
  return state, reset


def sam_perturb(params: Params, grads: Params, rho: float, include: Callable[[Path], bool] = lambda p: True
                ) -> Params:
  """SAM's first step: ``p + rho * g / (||g|| + 1e-12)`` for the params SAM holds (``include``).

  The norm is the global L2 norm over exactly those params' gradients (SAM's ``_grad_norm`` over its
  param groups); the others are returned unchanged.
  """
  flat_p, flat_g = traverse_util.flatten_dict(params), traverse_util.flatten_dict(grads)
  held = [k for k in flat_p if include(k)]
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(flat_g[k])) for k in held))
  scale = rho / (grad_norm + 1e-12)
  return traverse_util.unflatten_dict({k: p + flat_g[k] * scale if k in held else p for k, p in flat_p.items()})


def sar_code_lr(batch_size: int) -> float:
  """SAR's learning rate for the LayerNorms of timm ViTs: 0.001 * B / 64 (TENT, SAR, DCT, PCSR's base)."""
  return 0.001 * batch_size / 64


def field(default: Any, check: Any = None, *, size: Optional[int] = None) -> Any:
  """A method's hyperparameter declared with the values it accepts, which `Method.__post_init__` checks (so
  ``methods.get`` and direct construction refuse alike, in one line: ``<method> <field>: expected ..., got ...``).

  ``check`` is a range as text: ``"> 0"``, ``">= 0"``, ``"[0, 1]"``, ``"[0, 1)"``, ``"(0, 1]"`` (an int or float
  field's value, a tuple field's every element), or a tuple of the allowed values (a str field); None: any finite
  value. ``size``: the exact length of a tuple field. Besides: an int field takes ints, a float field ints and
  floats, all finite (tuple elements too), and an ``Optional`` field also None.
  """
  return dataclasses.field(default=default, metadata={"check": check, "size": size})


_RANGE = re.compile(r"^(?:(>=|>)\s*(\S+)|([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])]))$")


@dataclasses.dataclass(frozen=True)
class Spec:
  """What one hyperparameter accepts (`field`): ``kind`` is 'int', 'float', 'str' or 'bool' (a tuple's elements
  when ``is_tuple``)."""

  name: str
  kind: str
  is_tuple: bool = False
  optional: bool = False
  check: Any = None
  size: Optional[int] = None

  def bounds(self) -> tuple[float, float, bool, bool]:
    """``(lo, hi, lo_open, hi_open)`` of a range check."""
    m = _RANGE.match(self.check.strip())
    if m is None:
      raise ValueError(f"{self.name}: not a range: {self.check!r}")
    if m.group(1):
      return float(m.group(2)), math.inf, m.group(1) == ">", True
    return float(m.group(4)), float(m.group(5)), m.group(3) == "(", m.group(6) == ")"

  def describe(self) -> str:
    if isinstance(self.check, tuple):
      return "one of " + ", ".join(map(str, self.check))
    what = {"int": "integer", "float": "number", "str": "string"}.get(self.kind, self.kind)
    rng = ""
    if self.check is not None:
      lo, hi, lo_open, hi_open = self.bounds()
      if hi == math.inf:
        rng = f" {'>' if lo_open else '>='} {lo:g}"
      else:
        rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if self.is_tuple:
      text = f"{self.size if self.size is not None else 'a tuple of'} {what}s{rng}"
    else:
      text = f"{'an' if what[0] in 'aeiou' else 'a'} {what}{rng}"
    if self.kind == "float" and self.check is None:
      text = text.replace("number", "finite number")
    return ("None or " if self.optional else "") + text

  def accepts(self, value: Any) -> bool:
    if value is None:
      return self.optional
    if self.is_tuple:
      return (isinstance(value, tuple) and (self.size is None or len(value) == self.size)
              and all(self._accepts_one(v) for v in value))
    return self._accepts_one(value)

  def _accepts_one(self, v: Any) -> bool:
    if self.kind in ("int", "float"):
      number = int if self.kind == "int" else (int, float)
      if isinstance(v, bool) or not isinstance(v, number) or not math.isfinite(v):
        return False
      if self.check is None:
        return True
      lo, hi, lo_open, hi_open = self.bounds()
      return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if self.kind == "str" and not isinstance(v, str):
      return False
    if isinstance(self.check, tuple):
      return v in self.check
    return True


@functools.cache
def specs(cls: type) -> tuple[Spec, ...]:
  """The `Spec` of every hyperparameter of method class ``cls`` declared with `field`."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if "check" not in f.metadata:
      continue
    t = hints[f.name]
    optional = typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)
    if optional:
      t = next(a for a in typing.get_args(t) if a is not type(None))
    is_tuple = typing.get_origin(t) is tuple
    if is_tuple:
      t = typing.get_args(t)[0]
    out.append(Spec(f.name, t.__name__, is_tuple, optional, f.metadata["check"], f.metadata["size"]))
  return tuple(out)


def check_hyperparameters(method: Any) -> None:
  """One-line `UserError` for the first hyperparameter of ``method`` outside what its `field` declares, then for
  the rules that tie fields together in every method that has them: a ``mean`` and a ``std`` per channel, a kNN
  bank that holds at least ``num_neighbors`` entries, and Nesterov only with momentum (as ``torch.optim.SGD``)."""
  for spec in specs(type(method)):
    value = getattr(method, spec.name)
    if not spec.accepts(value):
      raise UserError(f"{method.name} {spec.name}: expected {spec.describe()}, got {value!r}")
  mean, std = getattr(method, "mean", None), getattr(method, "std", None)
  if mean is not None and std is not None and (not mean or len(mean) != len(std)):
    raise UserError(f"{method.name} mean/std: expected one mean and one std per channel, got {mean} and {std}")
  queue, neighbors = getattr(method, "queue_size", None), getattr(method, "num_neighbors", None)
  if queue is not None and neighbors is not None and queue < neighbors:  # a kNN bank (AdaContrast, DePT-G)
    raise UserError(f"{method.name} queue_size: expected at least num_neighbors ({neighbors}), got {queue}")
  if getattr(method, "nesterov", False) and getattr(method, "momentum", None) == 0:
    raise UserError(f"{method.name} nesterov: expected momentum > 0 with Nesterov (as torch.optim.SGD)")


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

  def check_inputs(self) -> None:
    """One-line `UserError` if a file the method reads is missing or foreign (DePT-G's trained prompts): called by
    the harness before any work. Nothing to check by default."""

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
