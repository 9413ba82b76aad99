"""Tiny models and batches shared by the engine tests (a few thousand params; CPU-fast)."""

from __future__ import annotations

import dataclasses
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pcsr_jax.models import ViTConfig, create, init_params

TINY = ViTConfig(embed_dim=24, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=10, mlp_ratio=2.0)


@functools.lru_cache(maxsize=None)
def _tiny_model(cfg: ViTConfig, seed: int, head_scale: float):
  model = create(cfg)
  params = jax.tree.map(np.asarray, init_params(model, jax.random.key(seed)))
  params["head"]["kernel"] = params["head"]["kernel"] * head_scale
  return model, params


def tiny_model(cfg: ViTConfig = TINY, seed: int = 0, head_scale: float = 3.0):
  """A random tiny ViT whose head is scaled up so that some predictions are confident (entropy < E0).

  Initialized once per arguments (the init is a compile); each call gets its own copy of the params.
  """
  model, params = _tiny_model(cfg, seed, head_scale)
  return model, jax.tree.map(np.array, params)


def batches(n: int, batch_size: int, cfg: ViTConfig = TINY, seed: int = 0, last: int | None = None):
  rng = np.random.default_rng(seed)
  sizes = [batch_size] * n if last is None else [batch_size] * (n - 1) + [last]
  return [rng.standard_normal((s, cfg.img_size, cfg.img_size, cfg.in_chans)).astype(np.float32) for s in sizes]


def dept_prompts(model, params, directory, stages: int = 2, prompts: int = 3, seed: int = 1) -> str:
  """A DePT-G prompts folder for ``model``/``params`` (freshly initialised prompts and small DINO heads, the
  checkpoint's head), as `pcsr_jax.experiments.train_prompts` writes one; returns the folder."""
  from pcsr_jax import checkpoint
  from pcsr_jax.methods import dept
  from pcsr_jax.models import prompted

  pc = prompted.PromptConfig(stages=stages, prompts=prompts, dino_hidden=16, dino_bottleneck=8, dino_out=12)
  extra = jax.device_get(prompted.init_extra(prompted.create(model, pc), jax.random.key(seed)))
  dept.save_prompts(str(directory), dict(extra, head=params["head"]), pc,
                    dict(checkpoint_sha256=checkpoint.params_digest(params), command="tests/tiny.py"))
  return str(directory)


@dataclasses.dataclass(frozen=True)
class StandInUNetConfig:
  image_size: int = 32
  in_channels: int = 3


class StandInUNet(nn.Module):
  """A small eps model with the diffusion UNet's interface (``apply({'params': p}, x_nhwc, t_int)`` -> eps and
  the variance value per channel; ``config.image_size``, ``config.in_channels``): DDA's tests run the method's
  own code around it where guided-diffusion's UNet would cost minutes on a CPU."""

  config: StandInUNetConfig = StandInUNetConfig()

  @nn.compact
  def __call__(self, x, t):
    temb = jnp.sin(t.astype(jnp.float32)[:, None] / 100.0 * jnp.arange(1, 9, dtype=jnp.float32))
    h = nn.Conv(8, (3, 3))(x) + nn.Dense(8)(temb)[:, None, None, :]
    return nn.Conv(2 * x.shape[-1], (3, 3))(jnp.tanh(h))


_PROMPT_DIRS: dict[str, str] = {}


_UNET_DIRS: dict[int, str] = {}


def dda_unet(directory: str, seed: int = 0) -> str:
  """A tiny diffusion checkpoint as convert_weights.py writes one (guided-diffusion's UNet at 32 px: 32 channels,
  multipliers (1, 2), one res block per level, attention at 16 px, learned sigma; random weights); returns the
  folder."""
  from pcsr_jax import checkpoint
  from pcsr_jax.models.unet import UNet, UNetConfig

  cfg = UNetConfig(image_size=32, num_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(16,),
                   out_channels=6, num_head_channels=16, resblock_updown=True, use_scale_shift_norm=True)
  x, t = jnp.zeros((1, 32, 32, 3)), jnp.zeros((1,), jnp.int32)
  params = jax.device_get(UNet(cfg).init(jax.random.key(seed), x, t)["params"])
  meta = checkpoint.make_unet_meta(cfg, dict(diffusion_steps=1000, noise_schedule="linear", learn_sigma=True),
                                   source="tests/tiny.py")
  return checkpoint.save(directory, params, meta)


def required_args(name: str, model, params) -> dict:
  """The method arguments a registered method cannot run without on ``model``/``params``: DePT-G's prompts
  (written once per checkpoint into a temporary folder), DDA's diffusion checkpoint (written once; with 2 steps
  to keep the tests quick); DPCore's source filter keeping any 2 images (random weights: no entropy below
  ln(C) / 2 - 1) and 2 steps on a new domain; nothing for the others."""
  import tempfile

  if name == "dpcore":
    return {"source_kept": 2, "source_margin": 1e6, "steps_new": 2}

  if name == "dda":
    if 0 not in _UNET_DIRS:
      _UNET_DIRS[0] = dda_unet(os.path.join(tempfile.mkdtemp(prefix="dda_unet_"), "unet"))
    return {"unet": _UNET_DIRS[0], "N": 2}
  if name != "dept-g":
    return {}
  from pcsr_jax import checkpoint

  digest = checkpoint.params_digest(params)
  if digest not in _PROMPT_DIRS:
    _PROMPT_DIRS[digest] = dept_prompts(model, params, tempfile.mkdtemp(prefix="dept_prompts_"))
  return {"prompts": _PROMPT_DIRS[digest]}


def adapted_at_batch_one(name: str, **hp) -> list:
  """The trainable leaves after two steps at batch size 1 of ``name`` with ``hp`` (the lr-doubling tests:
  ``lr=None`` against twice the B = 1 lr must give the same leaves)."""
  from pcsr_jax import engine, methods

  model, params = tiny_model()
  ad = engine.Adapter(methods.get(name, **hp), model, params, batch_size=1)
  state = ad.init_state()
  for x in batches(2, 1):
    state, _, _ = ad.step(state, x)
  return [np.asarray(v) for v in jax.tree.leaves(state.trainable)]
