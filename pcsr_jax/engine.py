"""The online adaptation engine: one jitted, donated, sharded step per method.

    adapter = Adapter(methods.get("pcsr"), model, params, batch_size=64)
    state = adapter.init_state()
    for images in stream:                      # NHWC float32, normalized
      state, logits, metrics = adapter.step(state, images)
    state = adapter.reset(state)               # reset to the source model (new domain)

    adapter = Adapter(..., mean=meta["mean"], std=meta["std"])  # the checkpoint's normalization
    state, logits, metrics = adapter.step(state, images_u8)    # NHWC uint8 (`Preprocess.to_uint8`)

* ``step(state, images)`` is a pure function of its inputs (the frozen
  backbone is passed to the compiled function as an argument, not baked in).
  It is compiled once per batch size: a smaller (ragged) last batch is padded
  to the full size and masked, so a whole stream compiles exactly once. The
  state buffers are donated, and nothing is copied to the host.
* ``eval_order='before'`` returns the logits of the forward that computed the
  loss (SAR's code); ``'after'`` re-runs the forward with the updated params
  (PCSR's Algorithm 1; a method whose step runs that forward itself returns it as ``after_logits``, VCT's third
  forward); ``'perturbed'`` returns a SAM method's second forward,
  at the perturbed weights (DPAL's code). The default is the method's own.
* The batch is sharded over a 1-D ``'data'`` mesh of all devices, params and
  state are replicated; the global batch is padded to a multiple of the device
  count. The batch is placed with ``jax.make_array_from_process_local_data``,
  so under ``jax.distributed.initialize`` each process passes its own rows
  (`local_rows`, `place_local`) and the step is unchanged.
* Input by dtype: float32 images are taken as normalized. uint8 images (4x
  fewer bytes to transfer) are normalized inside the compiled step with the
  checkpoint's ``mean``/``std`` given to the Adapter, by a lookup in
  `transforms.normalize_table`: bit for bit the host's `Preprocess.normalize`.
* ``predict(state, images)`` (`predict_placed`): the logits of a forward of the state's latest adapted params,
  without adapting (no loss, no update, the state neither changed nor donated): what a batch gets that the
  realistic protocol skips (`pcsr_jax.realtime`; Alfarra et al.'s `utils/online_eval.py:36`, ``model.model``).
  Compiled once, beside the step, on its first call.
* ``row_chunk=N`` runs every forward of the step in passes of N rows (`methods.rows.in_row_passes`): the same
  step up to float32 rounding, faster on CPUs at large batches (the activations of a pass stay in the caches).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pcsr_jax import platforms
from pcsr_jax.data.transforms import normalize_table
from pcsr_jax.errors import UserError
from pcsr_jax.methods.base import AdaptState, Method, merge, split
from pcsr_jax.models import vit

EVAL_ORDERS = ("before", "after", "perturbed")


def normalize_uint8(images: jax.Array, table: np.ndarray, valid: Optional[jax.Array] = None) -> jax.Array:
  """uint8 NHWC -> normalized float32 by ``table[value, channel]`` (`transforms.normalize_table`).

  Padded rows (``valid`` False) become 0, as the float path pads them, so the two paths feed the model
  identical arrays.
  """
  channels = images.shape[-1]
  flat = jnp.asarray(table.T.reshape(-1))  # [channels * 256]: channel-major
  x = jnp.take(flat, images.astype(jnp.int32) + 256 * jnp.arange(channels, dtype=jnp.int32), mode="clip")
  if valid is not None:
    x = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
  return x


def use_cpu_devices(n: Optional[int]) -> None:
  """Splits the host CPU into ``n`` JAX devices (None: leave jax's default, one). Call before any JAX
  computation. Why: XLA:CPU runs some ops of a step on one thread only (the attention's batched matmuls among
  them), so on an N-core machine N devices, each with 1/N of the batch, keep every core busy (ViT-S/16 TENT
  and Source steps ~10% faster on 2 cores, `python -m benchmarks.step_throughput --cpu-devices`). The batch is
  padded to a multiple of ``n`` (so with batch size 1, ``n`` > 1 only adds work), and the results equal
  one device's up to float32 rounding (gradients are summed per device, then across devices)."""
  if n is None:
    return
  if n < 1:
    raise UserError(f"--cpu-devices: expected a positive number of devices, got {n}")
  try:
    jax.config.update("jax_num_cpu_devices", int(n))
  except RuntimeError as e:  # the backend is already running: fine if it already has n CPU devices
    if len(jax.local_devices(backend="cpu")) != n:
      raise UserError(f"--cpu-devices: too late, {str(e).splitlines()[0]}") from None


CUDNN_ATTENTION_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")  # `Adapter.export` allows them


def data_mesh(devices: Optional[list] = None) -> Mesh:
  """A 1-D mesh named ``'data'`` over all (global) devices."""
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices), ("data",))


class Adapter:
  """Runs one method online over a stream of batches of a fixed size."""

  def __init__(self, method: Method, model, params: Any, *, batch_size: int, eval_order: Optional[str] = None,
               mesh: Optional[Mesh] = None, seed: int = 0, source_stats: Optional[dict] = None,
               mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
               row_chunk: Optional[int] = None, platform: Optional[str] = None):
    if batch_size < 1:
      raise UserError(f"batch_size: expected a positive integer, got {batch_size}")
    if row_chunk is not None and not (isinstance(row_chunk, int) and row_chunk >= 1):
      raise UserError(f"row_chunk: expected a positive integer, got {row_chunk}")
    self.row_chunk = row_chunk
    self.method = method
    self.eval_order = eval_order or method.default_eval_order
    if self.eval_order not in method.eval_orders:
      raise UserError(f"eval_order: expected {' or '.join(method.eval_orders)} for {method.name}, "
                      f"got '{self.eval_order}'")
    self.batch_size = batch_size
    if (mean is None) != (std is None):
      raise UserError("Adapter: give both mean and std (the checkpoint's normalization of uint8 input) or neither")
    self._table = None if mean is None else normalize_table(mean, std)
    self.mesh = mesh if mesh is not None else data_mesh()
    # The platform the step is built for: its mesh's, or given (lowering for a GPU or TPU from a CPU host,
    # `export`); the model's kernels and every method's switches follow it (`pcsr_jax.platforms`).
    self.platform = platforms.canonical(platform) if platform is not None else platforms.of_mesh(self.mesh)
    model = vit.for_platform(model, self.platform)
    n_dev = self.mesh.devices.size
    self.padded_batch = math.ceil(batch_size / n_dev) * n_dev
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    self.prep = dataclasses.replace(method.prepare(model, params, init_rng, batch_size), platform=self.platform)
    if method.uses_source_data() and method.source_data == "required" and source_stats is None:
      raise UserError(f"{method.name}: needs statistics of clean source data (--source-data)")
    if source_stats is not None:  # beside what `prepare` put there (CoTTA's source params)
      self.prep = dataclasses.replace(self.prep, consts={**(self.prep.consts or {}), **source_stats})
    frozen, trainable = split(self.prep.params, self.prep.is_trainable)
    opt_state = self.prep.tx.init(trainable)
    state = AdaptState(trainable=trainable, opt_state=opt_state, step=jnp.zeros((), jnp.int32), rng=state_rng,
                       resets=jnp.zeros((), jnp.int32), extra=method.init_extra(self.prep, trainable, opt_state))
    self._replicated = NamedSharding(self.mesh, P())
    self._batch_sharding = NamedSharding(self.mesh, P("data"))
    self.frozen = self._replicate(frozen)
    self.consts = self._replicate(self.prep.consts)
    self._initial = self._replicate(state)
    self.num_traces = 0  # how many times the step was traced (= compiled): one per stream
    self._step = jax.jit(self._step_impl, donate_argnums=(2,),
                         in_shardings=(self._replicated, self._replicated, self._replicated,
                                       self._batch_sharding, self._batch_sharding),
                         out_shardings=(self._replicated, self._batch_sharding, self._replicated))
    self._predict = jax.jit(self._predict_impl,
                            in_shardings=(self._replicated, self._replicated, self._replicated,
                                          self._batch_sharding, self._batch_sharding),
                            out_shardings=(self._batch_sharding, self._replicated))

  @property
  def num_trainable(self) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(self._initial.trainable)))

  def init_state(self) -> AdaptState:
    """A fresh copy of the source state (its buffers are donated to the step)."""
    return jax.tree.map(lambda x: x.copy(), self._initial)

  def reset(self, state: Optional[AdaptState] = None) -> AdaptState:
    """The state for a new domain after ``state`` (None: the first): the source state, but for what the
    method's official ``reset()`` keeps of its own state (`Method.extra_after_reset`; CMF's filter variance)."""
    fresh = self.init_state()
    if state is None:
      return fresh
    return fresh.replace(extra=self.method.extra_after_reset(fresh.extra, state.extra))

  def _step_impl(self, frozen, consts, state: AdaptState, images, valid):
    self.num_traces += 1
    if images.dtype == jnp.uint8:
      images = normalize_uint8(images, self._table, valid)
    # The traced statistics (not baked-in constants), and the mesh for a method's gathered rows (`shard_rows`).
    prep = dataclasses.replace(self.prep, consts=consts, mesh=self.mesh, row_chunk=self.row_chunk)
    state, logits, metrics = self.method.update(prep, frozen, state, images, valid)
    perturbed, after = metrics.pop("perturbed_logits", None), metrics.pop("after_logits", None)
    if self.eval_order == "perturbed":
      logits = perturbed
    elif self.eval_order == "after":  # a method whose official step ends with that forward returns it (VCT)
      logits = after if after is not None else self.method.forward(prep, frozen, state.trainable, images)[0]
    # A diverged step (NaN/inf logits or adapted params) must stop a run, not become "every prediction class 0".
    finite = jnp.all(jnp.where(valid[:, None], jnp.isfinite(logits), True))
    for leaf in jax.tree.leaves(state.trainable):
      finite &= jnp.all(jnp.isfinite(leaf))
    metrics["finite"] = finite
    return state, logits, metrics

  def _predict_impl(self, frozen, consts, state: AdaptState, images, valid):
    """A forward of the latest adapted params (`Method.forward`, the network the method adapts, as the official
    protocol's ``model.model``): ``(logits, {'finite': ...})``."""
    if images.dtype == jnp.uint8:
      images = normalize_uint8(images, self._table, valid)
    prep = dataclasses.replace(self.prep, consts=consts, mesh=self.mesh, row_chunk=self.row_chunk)
    logits = self.method.forward(prep, frozen, state.trainable, images)[0]
    return logits, {"finite": jnp.all(jnp.where(valid[:, None], jnp.isfinite(logits), True))}

  def _replicate(self, tree: Any) -> Any:
    """A pytree (the same on every process) put on every device of the mesh. Under `jax.distributed` the mesh
    has devices of other processes, which `device_put` accepts only from host data: leaves go through numpy."""
    if self._replicated.is_fully_addressable:
      return jax.device_put(tree, self._replicated)

    def put(x):
      if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
      return jax.device_put(np.asarray(x), self._replicated)
    return jax.tree.map(put, tree)

  def pad(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pads a batch of up to ``batch_size`` images to the compiled size; returns (images, valid)."""
    n = images.shape[0]
    if not 0 < n <= self.batch_size:
      raise UserError(f"batch of {n} images: expected 1 to {self.batch_size}")
    valid = np.arange(self.padded_batch) < n
    if n < self.padded_batch:
      pad = np.zeros((self.padded_batch - n,) + images.shape[1:], images.dtype)
      images = np.concatenate([images, pad])
    return images, valid

  def place(self, images) -> tuple[jax.Array, jax.Array]:
    """A batch (NHWC uint8, or float32 normalized) padded and put on the mesh: ``(images, valid)`` for
    `step_placed`."""
    images, valid = self.pad(self._input(images))
    return self.place_local(images, valid)

  def local_rows(self) -> tuple[int, int]:
    """``(lo, hi)``: the rows of the padded global batch that this process's devices hold (all of them in a
    one-process run). Under `jax.distributed` each process decodes and places only these."""
    index = self._batch_sharding.addressable_devices_indices_map((self.padded_batch,))
    spans = sorted((sl[0].indices(self.padded_batch)[:2] for sl in index.values()))
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
      raise ValueError(f"this process's devices hold non-adjacent rows {spans} of the batch")
    return spans[0][0], spans[-1][1]

  def place_local(self, images: np.ndarray, valid: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """This process's rows (`local_rows`) of a padded batch and their valid mask, put on the mesh."""
    images = self._input(images)
    images = jax.make_array_from_process_local_data(self._batch_sharding, images,
                                                    (self.padded_batch,) + images.shape[1:])
    valid = jax.make_array_from_process_local_data(self._batch_sharding, valid, (self.padded_batch,))
    return images, valid

  def _input(self, images) -> np.ndarray:
    """uint8 stays uint8 (normalized in the step); anything else is taken as normalized float32."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
      return images.astype(np.float32, copy=False)
    if self._table is None:
      raise UserError("uint8 images: the Adapter needs the checkpoint's normalization (Adapter(..., mean=, std=))")
    return images

  def step(self, state: AdaptState, images) -> tuple[AdaptState, jax.Array, dict[str, jax.Array]]:
    """One online step on a batch of up to ``batch_size`` images (NHWC uint8, or float32 normalized): the logits
    of those images, one row each (a smaller batch is padded to the compiled size inside, and the padding's rows
    cut off)."""
    shape, want = np.shape(images), self._image_shape()
    if len(shape) != 4 or tuple(shape[1:]) != want:
      raise UserError(f"images of shape {tuple(shape)}: expected [batch, {want[0]}, {want[1]}, {want[2]}] "
                      f"(NHWC at the checkpoint's img_size, meta['img_size'])")
    n = shape[0]
    state, logits, metrics = self.step_placed(state, self.place(images))
    return state, (logits if n == self.padded_batch else logits[:n]), metrics

  def step_placed(self, state: AdaptState, placed: tuple[jax.Array, jax.Array]
                  ) -> tuple[AdaptState, jax.Array, dict[str, jax.Array]]:
    """`step` on a batch already on the devices (`place`), e.g. one batch reused by a throughput benchmark."""
    return self._step(self.frozen, self.consts, state, *placed)

  def predict(self, state: AdaptState, images) -> jax.Array:
    """The logits of a forward of ``state``'s adapted params on a batch of up to ``batch_size`` images, without
    adapting (``state`` stays valid: it is not donated)."""
    n = np.shape(images)[0]
    logits, _ = self.predict_placed(state, self.place(images))
    return logits if n == self.padded_batch else logits[:n]

  def predict_placed(self, state: AdaptState, placed: tuple[jax.Array, jax.Array]
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`predict` on a batch already on the devices: ``(logits, {'finite': ...})``."""
    return self._predict(self.frozen, self.consts, state, *placed)

  def lower(self, state: AdaptState, placed: tuple[jax.Array, jax.Array]) -> jax.stages.Lowered:
    """The step lowered for these arguments: its program (``.as_text()``) and, compiled, XLA's cost analysis
    (``.compile().cost_analysis()``), as `benchmarks/profile_step.py` reads them. Traces once more."""
    return self._step.lower(self.frozen, self.consts, state, *placed)

  def export(self, platforms_: Optional[Sequence[str]] = None) -> Any:
    """The step exported (`jax.export`) for the platform it was built for (``platform=``; None) or for the
    lowering names in ``platforms_`` ("cuda", "tpu"), e.g. from a CPU host: its StableHLO (``.mlir_module()``)
    is what a GPU or TPU would compile. Lowering for another platform than the step's holds the step's
    variants (a CPU's closed forms on a GPU), which only a test of that mismatch wants."""
    if platforms_ is None:
      platforms_ = (platforms.LOWERING[self.platform],)
    args = (self.frozen, self.consts, self.init_state()) + self.place(np.zeros(
        (self.batch_size,) + self._image_shape(), np.uint8 if self._table is not None else np.float32))
    # cuDNN's fused attention is a custom call jax gives no serialization guarantee for: allowed here (the
    # program is for reading and compiling now, not for storing).
    allowed = [jax.export.DisabledSafetyCheck.custom_call(t) for t in CUDNN_ATTENTION_CALLS]
    return jax.export.export(self._step, platforms=tuple(platforms_), disabled_checks=allowed)(*args)

  def _image_shape(self) -> tuple[int, int, int]:
    c = self.prep.model.config
    return c.img_size, c.img_size, c.in_chans

  def state_to_host(self, state: AdaptState) -> Any:
    """A numpy pytree of ``state`` for checkpointing (the PRNG key as raw key data)."""
    return jax.tree.map(np.asarray, state.replace(rng=jax.random.key_data(state.rng)))

  def state_from_host(self, tree: Any) -> AdaptState:
    """Inverse of `state_to_host`, placed (replicated) on the mesh."""
    state = jax.tree.map(jnp.asarray, tree)
    state = state.replace(rng=jax.random.wrap_key_data(state.rng))
    return self._replicate(state)

  def params(self, state: AdaptState) -> Any:
    """The full params (backbone + adapted) of a state, e.g. to save or inspect."""
    return merge(self.frozen, state.trainable)
