"""The method arguments a benchmark needs to run a method at all, the same for the JAX and PyTorch sides.

DePT-G cannot run without a ``prompts`` folder (`pcsr_jax.methods.dept`, written by
``experiments/train_prompts.py``). A step's speed depends only on the shapes, so the benchmarks time it with
FRESHLY INITIALISED prompts and DINO heads (`prompted.init_extra`, seed `SEED`) at the official size
(`prompted.PromptConfig`'s defaults: 4 stages of 50 prompts, 2-layer DINO heads 2048 / 256 / 2048 as
``yhygao/DePT``'s config) and the checkpoint's own head: `jax_args` writes them as a prompts folder
(`dept.save_prompts`, in a temporary folder removed at exit), `torch_args` gives the PyTorch reference the very
same arrays. Every other method needs nothing.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from typing import Any

SEED = 0

_DIRS: dict[str, str] = {}  # checkpoint digest -> its prompts folder (one per process)
_LOCK = threading.Lock()  # gpu_report builds its JAX steps in threads


def fresh_extra(model) -> tuple[Any, dict]:
  """``(prompt config, params)``: `SEED`'s freshly initialised prompts and DINO heads of the plain model
  ``model`` at the official size, as numpy arrays."""
  import jax

  from pcsr_jax.models import prompted

  pc = prompted.PromptConfig()
  return pc, jax.device_get(prompted.init_extra(prompted.create(model, pc), jax.random.key(SEED)))


def jax_args(method: str, model, params) -> dict[str, str]:
  """``{'prompts': folder}`` for DePT-G on ``model``/``params`` (`fresh_extra` and ``params``' head, written once
  per checkpoint per process); ``{}`` for every other method."""
  if method != "dept-g":
    return {}
  from pcsr_jax import checkpoint
  from pcsr_jax.methods import dept

  digest = checkpoint.params_digest(params)
  with _LOCK:
    if digest not in _DIRS:
      directory = tempfile.mkdtemp(prefix="pcsr_bench_prompts_")
      atexit.register(shutil.rmtree, directory, ignore_errors=True)
      pc, extra = fresh_extra(model)
      dept.save_prompts(directory, dict(extra, head=params["head"]), pc,
                        dict(checkpoint_sha256=digest, command="benchmarks/method_args.py (fresh, for timing only)"))
      _DIRS[digest] = directory
  return {"prompts": _DIRS[digest]}


def torch_args(method: str, arch: str) -> dict[str, Any]:
  """The PyTorch reference's keyword arguments for ``method`` on ``arch``: for DePT-G the official sizes and
  `fresh_extra`'s prompts and DINO heads (the head stays the model's own, which is the JAX side's: both load
  the same weights); ``{}`` for every other method.

  JAX computes them on the CPU only: in a PyTorch worker a JAX GPU backend would reserve most of the GPU's
  memory ahead of PyTorch's step (this sets ``jax_platforms``, which only takes effect in a process where JAX
  has not started a backend yet, as in the benchmarks' PyTorch workers).
  """
  if method != "dept-g":
    return {}
  import jax

  from benchmarks.torch_methods.dept_g import torch_state
  from pcsr_jax.models import create, get_config

  jax.config.update("jax_platforms", "cpu")
  pc, extra = fresh_extra(create(get_config(arch)))
  return dict(stage_num=pc.stages, prompt_num=pc.prompts, nlayer_head=pc.dino_layers, hidden_dim=pc.dino_hidden,
              bottleneck_dim=pc.dino_bottleneck, out_dim=pc.dino_out, state=torch_state(extra))
