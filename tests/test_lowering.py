"""The accelerator path, kept from rotting on a CPU-only CI: every registered method's step (float32 and
bfloat16), DDA's sampler inside DDA's step, each attention kernel and the device corruptions are lowered
from this CPU for a GPU (``cuda``) and a TPU (`jax.export`), as the step is built for that platform
(`pcsr_jax.platforms`), and the program may hold no host callback (it would not lower), no float64 value and
none of the CPU-only forms (`ops.CLOSED_FORM_SCOPE`: the hand-written backward passes, the UNet's matmul
convolutions and channel-sum GroupNorms). The same checks find the CPU forms and the callback in a step built
for a CPU, so they can fail.

Kernels: ``--attention auto`` on every method; ``matmul``, ``xla`` and (GPU, bfloat16) ``cudnn`` on TENT, whose
step differentiates through attention (the kernel is the model's: the same for every method). jax's cuDNN
attention asks the host's CUDA libraries for cuDNN's version while it traces, which a CPU-only jaxlib lacks:
the `cudnn_version` fixture answers that one probe as the H200 machine's jax did (cuDNN 9.10, 91000); the
kernel and its lowering are jax's own."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcsr_jax import engine, methods, platforms
from pcsr_jax.data.generators import corrupt_device
from pcsr_jax.methods.base import split
from pcsr_jax.models import ops
from tiny import TINY, batches, required_args, tiny_model

# TINY with a head dim of 16: cuDNN's fused attention takes multiples of 8 up to 128 (TINY's is 12).
CFG = dataclasses.replace(TINY, embed_dim=32)
TARGETS = tuple((p, platforms.LOWERING[p]) for p in ("gpu", "tpu"))  # (the step's platform, the name jax lowers)
F64 = re.compile(r"[x<]f64\b")


@pytest.fixture(autouse=True)
def cudnn_version(monkeypatch):
  from jax._src.cudnn import fused_attention_stablehlo as fa

  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)


def _adapter(name: str, platform: str, dtype=None, attention: str = "auto") -> engine.Adapter:
  base, params = tiny_model(CFG)
  model = base.clone(dtype=dtype, attention=attention)
  method, stats = methods.get(name, **required_args(name, base, params)), None
  if method.uses_source_data():  # CFA's, FOA's statistics: arrays, computed here on the CPU
    cpu = model.clone(attention="matmul")
    prep = method.prepare(cpu, params, jax.random.key(0), 8)
    frozen, trainable = split(prep.params, prep.is_trainable)
    source = [(x, np.arange(len(x), dtype=np.int32) % CFG.num_classes) for x in batches(2, 8, CFG, seed=7)]
    stats = method.compute_source_stats(prep, frozen, trainable, iter(source))
  mesh = engine.data_mesh(jax.local_devices()[:1])
  return engine.Adapter(method, model, params, batch_size=8, source_stats=stats, mesh=mesh, platform=platform,
                        mean=(0.5,) * 3, std=(0.5,) * 3)


def _program(adapter: engine.Adapter, lowering: str) -> str:
  """The step's program for the lowering its platform names (`platforms.LOWERING`), or for ``lowering``."""
  try:
    default = platforms.LOWERING[adapter.platform] == lowering
    return (adapter.export() if default else adapter.export([lowering])).mlir_module()
  except Exception as e:  # a host callback (or any op without a rule for that platform) does not lower
    raise AssertionError(f"{adapter.method.name} did not lower for {lowering}: {type(e).__name__}: "
                         f"{str(e)[:300]}") from None


def _problems(text: str) -> list[str]:
  found = []
  if ops.CLOSED_FORM_SCOPE in text:
    found.append("a CPU-only form")
  if F64.search(text):
    found.append("a float64 value")
  if "callback" in text:
    found.append("a host callback")
  return found


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_every_step_lowers_for_a_gpu_and_a_tpu_without_host_float64_or_cpu_forms(name):
  for platform, lowering in TARGETS:
    for dtype in (None, jnp.bfloat16):
      ad = _adapter(name, platform, dtype)
      text = _program(ad, lowering)
      assert not _problems(text), (name, lowering, dtype, _problems(text))
      if platform == "gpu" and dtype is not None:  # auto: cuDNN's fused attention for bf16 on a GPU
        assert "cudnn" in text, f"{name}: no cuDNN attention in its bf16 GPU step"


@pytest.mark.parametrize("platform,lowering", TARGETS)
def test_each_attention_kernel_lowers(platform, lowering):
  kernels = [("matmul", None), ("xla", None), ("matmul", jnp.bfloat16), ("xla", jnp.bfloat16)]
  kernels += [("cudnn", jnp.bfloat16)] if platform == "gpu" else []
  for attention, dtype in kernels:
    ad = _adapter("tent", platform, dtype, attention)
    assert ad.prep.model.attention == attention and not ad.prep.model.cpu_ops
    text = _program(ad, lowering)
    assert not _problems(text), (attention, dtype, _problems(text))
    assert ("cudnn" in text) == (attention == "cudnn"), (attention, dtype)


def test_a_step_built_for_a_cpu_shows_what_the_checks_look_for():
  """The CPU's step holds the closed forms (and `auto` picks the matmul attention there); DDA's, with its PIL
  JPEG round trip, does not lower for a GPU at all: the checks above can fail."""
  ad = _adapter("tent", "cpu")
  assert ad.prep.model.attention == "matmul" and ad.prep.model.cpu_ops
  assert _problems(_program(ad, "cpu")) == ["a CPU-only form"]
  dda = _adapter("dda", "cpu")
  with pytest.raises(AssertionError, match="dda did not lower for cuda"):
    _program(dda, "cuda")


@pytest.mark.parametrize("lowering", [t[1] for t in TARGETS])
def test_the_device_corruptions_lower(lowering):
  images = jax.ShapeDtypeStruct((2, 64, 64, 3), jnp.uint8)
  for name in corrupt_device.DEVICE_CORRUPTIONS:
    corrupter = corrupt_device.BatchCorrupter(name, 3.0, 0, 32, size=64)
    fn = jax.jit(lambda x, c=corrupter: c(x, np.arange(2)))
    text = jax.export.export(fn, platforms=(lowering,))(images).mlir_module()
    assert not _problems(text), (name, _problems(text))
