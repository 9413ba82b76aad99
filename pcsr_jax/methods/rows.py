"""Row passes: every forward of the model in a step runs through `in_row_passes` (``--row-chunk``), and the
methods that run a pass on a dynamic subset of the batch gather it in fixed-size chunks (`kept_row_chunks`)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from pcsr_jax.methods.state import Prepared
from pcsr_jax.models import vit

Array = jax.Array
Params = Any


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
  a sown batch statistic), the batch runs in one pass (the passes: dead code). ``images`` may be a pytree of
  arrays whose leading axis is the batch (VCT's images and per-row tokens): each pass takes the same rows of each.
  """
  b, r = jax.tree.leaves(images)[0].shape[0], prep.row_chunk
  n_dev = prep.mesh.devices.size if prep.mesh is not None else 1
  if not splits_into_passes(b, r, n_dev):
    return fn(images)
  n = b // r
  # Pass i takes rows i, i + n, i + 2n, ...: each device's rows (a contiguous block) feed every pass evenly.
  passes = jax.tree.map(lambda a: a.reshape((r, n) + a.shape[1:]).swapaxes(0, 1), images)
  # Unrolled, not a `lax.map`: a loop stacks every pass's residuals into one buffer for the backward pass and
  # slices them out again, copies that took a fifth of TENT's non-matmul time at ViT-S/16 batch 64 (`python -m
  # benchmarks.profile_step --arch vit_small_patch16_224 --batch-size 64 --method tent --row-chunk 16`).
  # Unrolled, each pass keeps its own buffers: TENT's step there ran 6% faster (4 alternating runs of each), SAR's
  # 14% (one run of each); their compiles took a third to a half longer (each pass is compiled on its own).
  outs = [fn(jax.tree.map(lambda a: shard_rows(prep, a[i]), passes)) for i in range(n)]
  out = jax.tree.map(lambda *v: jnp.stack(v), *outs)
  if any(v.ndim < 2 or v.shape[1] != r for v in jax.tree.leaves(out)):
    return fn(images)
  return jax.tree.map(lambda v: v.swapaxes(0, 1).reshape((b,) + v.shape[2:]), out)


def features_and_logits(prep: Prepared, params: Params, images: Array) -> tuple[Array, Array]:
  """``(feature, logits)`` as `models.vit.features_and_logits` (the head's input and the logits from it), the
  model run in passes of ``prep.row_chunk`` rows (`in_row_passes`): CFA and AdaContrast read both."""
  return in_row_passes(prep, lambda x: vit.features_and_logits(prep.model, params, x), images)
