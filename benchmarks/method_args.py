"""The method arguments a benchmark needs to run a method at all, the same for the JAX and PyTorch sides.

DePT-G cannot run without a ``prompts`` folder (`pcsr_jax.methods.dept`, written by
``experiments/train_prompts.py``). A step's speed depends only on the shapes, so the benchmarks time it with
FRESHLY INITIALISED prompts and DINO heads (`prompted.init_extra`, seed `SEED`) at the official size
(`prompted.PromptConfig`'s defaults: 4 stages of 50 prompts, 2-layer DINO heads 2048 / 256 / 2048 as
``yhygao/DePT``'s config) and the checkpoint's own head: `jax_args` writes them as a prompts folder
(`dept.save_prompts`, in a temporary folder removed at exit), `torch_args` gives the PyTorch reference the very
same arrays. DDA cannot run without a diffusion checkpoint (``unet``): the benchmarks time it with a small
guided-diffusion UNet (`BENCH_UNET`: the built-in benchmark's config, 32 px, 1.4M params) at FRESH random weights
(the Flax init, seed `SEED`), written as a checkpoint for JAX (`jax_args`) and loaded into the PyTorch UNet
(``benchmarks/torch_methods/guided_unet.py``) for the reference (`torch_args`), at DDA's official step counts
(N 50 of the "100" respacing). The references of PCSR's authors' earlier methods (VCT, DCT, DPAL) take the
threshold E0 and the initial values of their random modules (DCT's generators, DPAL's prompts), which the JAX
side draws from its own seed: `lineage_args` draws them from the same distributions (a step's speed depends
only on their shapes). DPCore's source filter keeps every benchmark image, every batch after its first takes the
known-domain branch (`DPCORE`), and its reference starts from the JAX side's own prompts (`dpcore_args`). Every other
method needs nothing.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from typing import Any

SEED = 0

_DIRS: dict[str, str] = {}  # checkpoint digest -> its prompts folder, "dda" -> the UNet's (one per process)
_LOCK = threading.Lock()  # gpu_report builds its JAX steps in threads


def fresh_extra(model) -> tuple[Any, dict]:
  """``(prompt config, params)``: `SEED`'s freshly initialised prompts and DINO heads of the plain model
  ``model`` at the official size, as numpy arrays."""
  import jax

  from pcsr_jax.models import prompted

  pc = prompted.PromptConfig()
  return pc, jax.device_get(prompted.init_extra(prompted.create(model, pc), jax.random.key(SEED)))


def bench_unet():
  """DDA's UNet for the benchmarks: the built-in benchmark's config (`pcsr_jax.experiments.train_ddpm`'s
  defaults: 32 px, 32 channels, multipliers (1, 2, 2), one res block per level, attention at 8 px)."""
  from pcsr_jax.experiments import train_ddpm

  return train_ddpm.unet_config(train_ddpm.parse([]))


def fresh_unet() -> tuple[Any, dict]:
  """``(config, params)``: `SEED`'s freshly initialised `bench_unet` (the Flax init) as numpy arrays."""
  import jax
  import jax.numpy as jnp

  from pcsr_jax.models.unet import UNet

  cfg = bench_unet()
  x = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.in_channels), jnp.float32)
  return cfg, jax.device_get(UNet(cfg).init(jax.random.key(SEED), x, jnp.zeros((1,), jnp.int32))["params"])


def jax_args(method: str, model, params) -> dict[str, str]:
  """``{'prompts': folder}`` for DePT-G on ``model``/``params`` (`fresh_extra` and ``params``' head, written once
  per checkpoint per process); ``{'unet': folder}`` for DDA (`fresh_unet` as a diffusion checkpoint, once per
  process); ``{}`` for every other method."""
  if method == "dda":
    return {"unet": _dda_folder()}
  if method == "dpcore":
    return dict(DPCORE)
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


def _dda_folder() -> str:
  from pcsr_jax import checkpoint
  from pcsr_jax.experiments.train_ddpm import DIFFUSION

  with _LOCK:
    if "dda" not in _DIRS:
      directory = tempfile.mkdtemp(prefix="pcsr_bench_unet_")
      atexit.register(shutil.rmtree, directory, ignore_errors=True)
      cfg, params = fresh_unet()
      checkpoint.save(f"{directory}/unet", params, checkpoint.make_unet_meta(
          cfg, DIFFUSION, source="benchmarks/method_args.py (fresh, for timing only)"))
      _DIRS["dda"] = f"{directory}/unet"
  return _DIRS["dda"]


def torch_args(method: str, arch: str) -> dict[str, Any]:
  """The PyTorch reference's keyword arguments for ``method`` on ``arch``: for DePT-G the official sizes and
  `fresh_extra`'s prompts and DINO heads (the head stays the model's own, which is the JAX side's: both load
  the same weights); for DDA the PyTorch UNet with `fresh_unet`'s weights (on the GPU if there is one) and its
  image size; for VCT, DCT and DPAL `lineage_args`; ``{}`` for every other method.

  JAX computes them on the CPU only: in a PyTorch worker a JAX GPU backend would reserve most of the GPU's
  memory ahead of PyTorch's step (this sets ``jax_platforms``, which only takes effect in a process where JAX
  has not started a backend yet, as in the benchmarks' PyTorch workers).
  """
  if method in LINEAGE:
    return lineage_args(method, arch)
  if method == "dpcore":
    return dpcore_args(arch)
  if method not in ("dept-g", "dda"):
    return {}
  import jax

  jax.config.update("jax_platforms", "cpu")
  if method == "dda":
    return dict(unet=torch_unet(), image_size=bench_unet().image_size)
  from benchmarks.torch_methods.dept_g import torch_state
  from pcsr_jax.models import create, get_config

  pc, extra = fresh_extra(create(get_config(arch)))
  return dict(stage_num=pc.stages, prompt_num=pc.prompts, nlayer_head=pc.dino_layers, hidden_dim=pc.dino_hidden,
              bottleneck_dim=pc.dino_bottleneck, out_dim=pc.dino_out, state=torch_state(extra))


def torch_unet():
  """`fresh_unet` as the PyTorch reference UNet (``guided_unet.build``, the JAX params loaded through
  `pcsr_jax.weights.guided_diffusion.flax_to_torch`), eval mode, on the GPU if there is one."""
  import torch

  from benchmarks.torch_methods import guided_unet
  from pcsr_jax.weights.guided_diffusion import flax_to_torch

  cfg, params = fresh_unet()
  unet = guided_unet.build(cfg)
  unet.load_state_dict({k: torch.from_numpy(v) for k, v in flax_to_torch(params).items()}, strict=True)
  return unet.eval().to("cuda" if torch.cuda.is_available() else "cpu")


LINEAGE = ("vct", "dct", "dpal")
# DPCore's source statistics keep the source images whose prompted entropy is below ln(C) / 2 - 1, which random
# weights never reach: the benchmarks keep every one (a step's cost does not depend on which passed). Its branch
# test (the coreset prompt's loss below thr_rho x the unprompted one) decides between a 1-step and a 50-step
# branch, and on the benchmarks' one repeated batch it does not take the same one at every step (raw.md's first
# dpcore block): thr_rho 1e6 makes every batch after the first known on both sides, so both time the known step.
DPCORE = {"source_margin": 1e6, "source_kept": 2, "thr_rho": 1e6}


def dpcore_args(arch: str) -> dict[str, Any]:
  """DPCore's reference arguments on ``arch``: `DPCORE`'s, and the JAX side's own initial prompts (`DPCore`'s
  default ``num_prompts`` and ``seed``), so that both sides adapt the very same prompts."""
  import numpy as np

  from pcsr_jax import methods
  from pcsr_jax.models import create, get_config

  m = methods.get("dpcore")
  prompts = np.asarray(m.initial_prompts(create(get_config(arch))))
  return dict(source_threshold=DPCORE["source_margin"], num_samples=DPCORE["source_kept"],
              thr_rho=DPCORE["thr_rho"], prompt_init=prompts, num_prompts=m.num_prompts)


def lineage_args(method: str, arch: str) -> dict[str, Any]:
  """VCT's, DCT's and DPAL's reference arguments on ``arch``: E0 = 0.4 ln C, and `SEED`'s draws of DCT's
  generators (PyTorch's default Linear init, blocks 0-8) and DPAL's prompts (its uniform init)."""
  import math

  import numpy as np

  from pcsr_jax.models import get_config, vit

  c = get_config(arch)
  rng = np.random.default_rng(SEED)
  kw: dict[str, Any] = {"margin": 0.4 * math.log(c.num_classes)}
  d = c.embed_dim
  if method == "dct":
    u = lambda *shape: rng.uniform(-d ** -0.5, d ** -0.5, shape).astype(np.float32)
    kw["generator_init"] = {i: (u(3 * d, d), u(3 * d)) for i in range(min(9, c.depth))}
  if method == "dpal":
    bound = vit.vpt_bound(c)
    u = lambda *shape: rng.uniform(-bound, bound, shape).astype(np.float32)
    kw["prompt_init"] = {"prompt_embeddings": u(1, 1, d), "deep_prompt_embeddings": u(c.depth - 1, 1, d)}
  return kw
