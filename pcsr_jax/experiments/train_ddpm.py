"""Trains the built-in benchmark's diffusion model: a small guided-diffusion UNet on clean Fashion-MNIST train.

    python experiments/train_ddpm.py                     # regenerates assets/fmnist_ddpm
    python experiments/train_ddpm.py --out /tmp/ddpm --steps 10      # a quick look
    python experiments/train_ddpm.py ... --resume        # continue an interrupted run where it stopped

DDA (``pcsr_jax.methods.dda``) projects each test image towards the source domain with an unconditional
diffusion model of that domain; on the built-in benchmark the source domain is Fashion-MNIST train, the images
the source ViT (``assets/fmnist_vit``) was trained on: 28 px grey zero-padded to 32 px, repeated over 3 channels,
in [-1, 1] (``fashion_mnist.load``, then ``x / 127.5 - 1``, as ``train_source.py`` does).

The recipe is guided-diffusion's (``image_train.py``, ``train_util.TrainLoop``, ``gaussian_diffusion.py``,
``resample.UniformSampler``, ``image_datasets.load_data``) scaled down:

* the process: 1000 steps, the linear beta schedule, eps prediction with a learned-range variance
  (``learn_sigma``); the loss is the hybrid one, ``mse + vb`` per image (`pcsr_jax.diffusion.training_losses`:
  ``LossType.MSE`` with the VLB term training the variance only), averaged over the batch with the uniform
  sampler's weights (all 1), timesteps drawn uniformly from 0..999;
* AdamW (torch's defaults: betas 0.9 / 0.999, eps 1e-8), weight decay 0, a constant learning rate (no
  ``lr_anneal_steps``), no gradient clipping, float32 (no fp16 loss scaling); an EMA of the params updated
  after every step, and the EMA is what the checkpoint holds (what guided-diffusion's samplers load);
* random horizontal flips (``load_data``'s ``random_flip``), one pass over a fresh permutation per epoch;
* the UNet: guided-diffusion's ``UNetModel`` (`pcsr_jax.models.unet`) at 32 px with the 256 px model's options
  (``resblock_updown``, ``use_scale_shift_norm``, heads of ``num_head_channels``, dropout 0).

Scaled down, each stated: the 256 px model has 256 channels, multipliers (1, 1, 2, 2, 4, 4), 2 res blocks per
level and attention at 32, 16, 8 px (553M params); here 32 channels, (1, 2, 2), one res block per level,
attention at 8 px and in the middle block (1.37M params), so that training fits about 30 minutes of a
2-core CPU. For a run of a few thousand steps (guided-diffusion trains for hundreds of thousands) the
learning rate is 5e-4 (its default 1e-4) and the EMA rate 0.995 (its 0.9999, whose horizon of 10,000 steps
would average mostly the random init), batch 16 (its ImageNet runs: 256; a step of 16 takes 1-2 s here).

Deterministic under ``--seed``: the init, the epoch permutations and flips, and per step the timesteps and
the noise (from the seed and the step number), at the highest matmul precision; a run stopped at any point
(``--stop-after``, a kill) and continued with ``--resume`` from its last saved state (``OUT/resume``, every
``--checkpoint-every`` steps) ends with the same params bit for bit as a run straight through. ``OUT`` then
holds the diffusion checkpoint (``checkpoint.load(OUT)`` -> ``(UNet, EMA params, meta)``) and
``record.json``: the command, the UNet config, the seed, steps, the loss curve, the held-out eps-MSE of the EMA
model, the wall time, the git commit and the SHA-256 of the params (`checkpoint.params_digest`); the
checkpoint's metadata carries the same record under ``training``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from pcsr_jax import files
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments import train_checks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
DEFAULT_OUT = os.path.join(ROOT, "assets", "fmnist_ddpm")
FORMAT_STATE = "pcsr-jax train_ddpm state v1"
DIFFUSION = dict(diffusion_steps=1000, noise_schedule="linear", learn_sigma=True, timestep_respacing="",
                 use_kl=False, predict_xstart=False, rescale_timesteps=False, rescale_learned_sigmas=False)
EVAL_TIMESTEPS = (100, 500, 900)  # the held-out eps-MSE of the record
EVAL_IMAGES = 512


def parse(argv: Optional[Sequence[str]]):
  p = ArgumentParser(prog="train_ddpm.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=DEFAULT_OUT, help="checkpoint folder to write (default: assets/fmnist_ddpm)")
  p.add_argument("--resume", action="store_true", help="continue the run saved in --out/resume")
  p.add_argument("--force", action="store_true", help="overwrite a finished --out")
  p.add_argument("--fashion-mnist-dir", help="dir with the idx(.gz) files (default: Debian's, then TFDS)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--stop-after", type=int, help="save and stop after this many steps (resume later with --resume)")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--lr", type=float, default=5e-4)
  p.add_argument("--ema-rate", type=float, default=0.995)
  p.add_argument("--num-channels", type=int, default=32)
  p.add_argument("--channel-mult", default="1,2,2", help="comma-separated multipliers per level")
  p.add_argument("--num-res-blocks", type=int, default=1)
  p.add_argument("--attention-resolutions", default="8", help="comma-separated resolutions in px ('' for none)")
  p.add_argument("--num-head-channels", type=int, default=32)
  p.add_argument("--train-limit", type=int, help="train on the first N images only (quick checks)")
  p.add_argument("--log-every", type=int, default=50, help="one point of the loss curve every N steps")
  p.add_argument("--checkpoint-every", type=int, default=100, help="save the state for --resume every N steps")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--eval-images", type=int, default=EVAL_IMAGES,
                 help=f"the record's held-out eps-MSE over the first N test images (default {EVAL_IMAGES})")
  a = p.parse_args(argv)
  train_checks.check_flags(a, positive=("steps", "stop_after", "batch_size", "num_channels", "num_res_blocks",
                                        "train_limit", "log_every", "checkpoint_every", "num_head_channels",
                                        "eval_images"), positive_floats=("lr",))
  if not 0.0 <= a.ema_rate < 1.0:
    raise UserError(f"--ema-rate: expected a value in [0, 1), got {a.ema_rate}")
  for flag, kind in (("channel_mult", float), ("attention_resolutions", int)):
    text = getattr(a, flag)
    try:
      values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
      values = (math.nan,)
    if not all(math.isfinite(v) and v > 0 for v in values):
      raise UserError(f"--{flag.replace('_', '-')}: expected comma-separated numbers > 0, got {text!r}")
    setattr(a, flag, values)
  return a


def unet_config(a) -> Any:
  """The `UNetConfig` of the flags (its own checks name the field at fault). An attention resolution that is
  none of the UNet's levels is refused: guided-diffusion would silently put no attention there."""
  from pcsr_jax.models.unet import UNetConfig

  cfg = UNetConfig(image_size=32, in_channels=3, out_channels=6, num_channels=a.num_channels,
                   channel_mult=a.channel_mult, num_res_blocks=a.num_res_blocks,
                   attention_resolutions=a.attention_resolutions, num_head_channels=a.num_head_channels,
                   resblock_updown=True, use_scale_shift_norm=True, dropout=0.0)
  levels = [cfg.image_size // 2 ** i for i in range(len(cfg.channel_mult))]
  unused = [r for r in cfg.attention_resolutions if r not in levels]
  if unused:
    raise UserError(f"--attention-resolutions: {unused} px is not a resolution of this UNet (its levels: {levels} "
                    f"px with --channel-mult {','.join(map(str, cfg.channel_mult))})")
  return cfg


class Trainer:
  """The model, optimizer, EMA and compiled step; its ``state`` (params, EMA, optimizer, step) is what is saved."""

  def __init__(self, cfg, *, seed: int, lr: float, ema_rate: float):
    import jax
    import jax.numpy as jnp
    import optax

    from pcsr_jax import diffusion
    from pcsr_jax.models.unet import UNet

    self.cfg, self.model = cfg, UNet(cfg)
    self.schedule = s = diffusion.make_schedule(DIFFUSION["diffusion_steps"], DIFFUSION["noise_schedule"])
    key = jax.random.key(seed)
    x = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.in_channels), jnp.float32)
    params = self.model.init(jax.random.fold_in(key, 0), x, jnp.zeros((1,), jnp.int32))["params"]
    self.noise_key = jax.random.fold_in(key, 1)
    self.tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    self.state = dict(params=params, ema=jax.tree.map(jnp.copy, params), opt=self.tx.init(params), step=jnp.zeros((), jnp.int32))
    model, tx = self.model, self.tx

    def step(state, images):
      kt, kn = jax.random.split(jax.random.fold_in(self.noise_key, state["step"]))
      t = jax.random.randint(kt, (images.shape[0],), 0, s.num_timesteps)  # UniformSampler: weights all 1
      noise = jax.random.normal(kn, images.shape, jnp.float32)

      def loss_fn(p):
        terms = diffusion.training_losses(s, lambda xt, tt: model.apply({"params": p}, xt, tt), images, t, noise)
        return terms["loss"].mean(), terms

      (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
      updates, opt = tx.update(grads, state["opt"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      ema = jax.tree.map(lambda e, q: e * ema_rate + q * (1.0 - ema_rate), state["ema"], params)
      metrics = dict(loss=loss, mse=terms["mse"].mean(), vb=terms["vb"].mean())
      return dict(params=params, ema=ema, opt=opt, step=state["step"] + 1), metrics

    self._step = jax.jit(step, donate_argnums=(0,))

  def step(self, images) -> dict:
    """One step on ``[B, 32, 32, 3]`` float32 images in [-1, 1]."""
    self.state, metrics = self._step(self.state, images)
    return metrics

  def host_state(self) -> Any:
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, jax.device_get(self.state))

  def load_state(self, tree: Any) -> None:
    import jax
    import jax.numpy as jnp

    self.state = jax.tree.map(jnp.asarray, tree)


def eps_mse(model, params, images, timesteps: Sequence[int], seed: int = 0, batch: int = 256) -> dict[int, float]:
  """Mean squared error of the eps prediction of ``model`` on ``images`` (float32 in [-1, 1]) noised with
  ``q_sample`` at each original timestep of ``timesteps`` (the noise from ``seed``): how well the model denoises;
  predicting zero scores about 1."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pcsr_jax import diffusion

  s = diffusion.make_schedule(DIFFUSION["diffusion_steps"], DIFFUSION["noise_schedule"])
  c = images.shape[-1]

  # params are an argument, not a closure: closed over they would be baked into the program as constants.
  @jax.jit
  def err(params, x0, t, key):
    tt = jnp.full((x0.shape[0],), t, jnp.int32)
    noise = jax.random.normal(key, x0.shape, jnp.float32)
    eps = model.apply({"params": params}, diffusion.q_sample(s, x0, tt, noise), tt)[..., :c]
    return jnp.sum((eps - noise) ** 2)

  out = {}
  for t in timesteps:
    total = 0.0
    for i in range(0, len(images), batch):
      total += float(err(params, jnp.asarray(images[i:i + batch]), t, jax.random.fold_in(jax.random.key(seed), i)))
    out[int(t)] = total / float(np.prod(images.shape))
  return out


def run_key(a) -> str:
  """What a resumed run must share with the saved one: every setting that changes the numbers. Not ``--steps``:
  the learning rate is constant and each step's batch, timesteps and noise depend on the step number alone, so a
  shorter run is exactly the start of a longer one, and a run may be resumed with another ``--steps``. Nor
  ``--eval-images``: it only scores the finished model."""
  keep = {k: v for k, v in vars(a).items() if k not in ("resume", "force", "stop_after", "checkpoint_every",
                                                      "no_progress", "out", "fashion_mnist_dir", "steps",
                                                      "eval_images")}
  return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def reproducing_command(argv: Sequence[str]) -> str:
  """The command line that makes the same model in one go: ``argv`` without ``--resume``, ``--force`` and
  ``--stop-after``."""
  keep, skip = [], False
  for x in argv:
    if skip:
      skip = False
    elif x in ("--resume", "--force"):
      continue
    elif x == "--stop-after":
      skip = True
    elif not x.startswith("--stop-after="):
      keep.append(x)
  return "python experiments/train_ddpm.py " + " ".join(shlex.quote(x) for x in keep)


def git_commit() -> Optional[str]:
  """The repo's HEAD commit, with '-dirty' when tracked files differ from it; None outside a git checkout."""
  try:
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, check=True, timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("-dirty" if dirty else "")


def batch_images(x_train, seed: int, step: int, batch_size: int):
  """Step ``step``'s batch: the rows of the epoch's permutation (``default_rng([seed, epoch])``), each flipped
  horizontally with probability 1/2 (drawn with the permutation), as float32 in [-1, 1]."""
  import numpy as np

  per_epoch = len(x_train) // batch_size  # drop the ragged tail: one compiled shape
  epoch, i = divmod(step, per_epoch)
  rng = np.random.default_rng([seed, epoch])
  perm = rng.permutation(len(x_train))
  flips = rng.random(len(x_train)) < 0.5
  idx = perm[i * batch_size:(i + 1) * batch_size]
  x = x_train[idx].astype(np.float32) / 127.5 - 1.0
  return np.where(flips[idx][:, None, None, None], x[:, :, ::-1], x)


def main(argv: Optional[Sequence[str]] = None) -> int:
  a = parse(argv)
  out = os.path.abspath(a.out)
  files.check_output_dir(out, "--out", beside=True)  # the model is written beside it, then renamed over it
  finished = os.path.isfile(os.path.join(out, "record.json"))
  if finished and not a.force:
    raise UserError(f"--out {a.out}: holds a trained model already (pass --force to overwrite)")
  resume_dir = os.path.join(out, "resume")
  if a.resume and not os.path.isfile(os.path.join(resume_dir, "state.json")):
    raise UserError(f"--resume: no saved progress in {resume_dir}")
  if os.path.exists(out) and not (finished or os.path.isdir(resume_dir)):
    raise UserError(f"--out {a.out}: exists and is not a train_ddpm.py folder")

  import jax
  import numpy as np
  from tqdm import tqdm

  from pcsr_jax import checkpoint
  from pcsr_jax.data import fashion_mnist

  jax.config.update("jax_default_matmul_precision", "highest")
  cfg = unet_config(a)
  x_train, _ = fashion_mnist.load("train", a.fashion_mnist_dir)
  x_test, _ = fashion_mnist.load("test", a.fashion_mnist_dir)
  if a.train_limit:
    x_train = x_train[:a.train_limit]
  if len(x_train) < a.batch_size:
    raise UserError(f"--batch-size {a.batch_size}: more than the {len(x_train)} training images")
  key = run_key(a)
  trainer = Trainer(cfg, seed=a.seed, lr=a.lr, ema_rate=a.ema_rate)
  n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(trainer.state["params"]))
  argv = list(sys.argv[1:] if argv is None else argv)
  history: list = []
  sessions: list = []  # one entry per process that trained: where it started, its code and command
  start, seconds_before = 0, 0.0
  if a.resume:
    saved = files.load_trainer(resume_dir, trainer, FORMAT_STATE)
    if saved.get("key") != key:
      raise UserError(f"--resume: {resume_dir} was saved by a run with other settings; rerun without --resume to "
                      f"start over")
    start, history, seconds_before = int(saved["step"]), saved["history"], float(saved["seconds"])
    sessions = saved["sessions"]
    if start > a.steps:  # else the record would say --steps while the params hold `start` steps
      raise UserError(f"--steps {a.steps}: the saved state in {resume_dir} is at step {start}, after it; resume "
                      f"with --steps {start} or more, or rerun without --resume to start over")
  else:
    shutil.rmtree(out if finished else resume_dir, ignore_errors=True)
  per_epoch = len(x_train) // a.batch_size
  print(f"train_ddpm: UNet {n_params / 1e6:.2f}M params (num_channels {cfg.num_channels}, channel_mult "
        f"{list(cfg.channel_mult)}, attention at {list(cfg.attention_resolutions)} px), {len(x_train):,} images, "
        f"{a.steps} steps of {a.batch_size} ({a.steps / per_epoch:.2f} epochs)"
        + (f"; resuming at step {start}" if start else ""), flush=True)
  bar = tqdm(total=a.steps, initial=start, desc="ddpm", unit="step", disable=a.no_progress, file=sys.stderr)
  sessions.append(dict(start_step=start, git_commit=git_commit(), command=reproducing_command(argv) +
                       (" --resume" if a.resume else "")))
  # sums: the open curve point's running totals (saved with the state, so a resumed curve is the same)
  t0, step, sums = time.time(), start, dict(saved["partial"]) if a.resume else {}
  stop = a.steps if a.stop_after is None else min(a.steps, start + a.stop_after)
  try:
    while step < stop:
      metrics = trainer.step(batch_images(x_train, a.seed, step, a.batch_size))
      step += 1
      bar.update(1)
      values = {k: float(v) for k, v in metrics.items()}
      train_checks.check_finite(step, a.lr, loss=values["loss"])
      for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v
      if step % a.log_every == 0 or step == a.steps:
        count = step - (history[-1]["step"] if history else 0)
        history.append(dict(step=step, **{k: round(v / count, 5) for k, v in sums.items()}))
        sums = {}
        bar.set_postfix(loss=history[-1]["loss"], mse=history[-1]["mse"])
      if step % a.checkpoint_every == 0 or step == stop:
        train_checks.check_finite(step, a.lr, params=trainer.state["params"])
        sessions[-1]["end_step"] = step
        files.save_trainer(resume_dir, trainer, FORMAT_STATE, dict(
            key=key, step=step, history=history, partial=sums, sessions=sessions,
            seconds=seconds_before + time.time() - t0))
  finally:
    bar.close()
  seconds = seconds_before + time.time() - t0
  if step < a.steps:
    print(f"stopped after step {step} of {a.steps} ({seconds:.0f} s); continue with --resume", flush=True)
    return 0
  if sums:  # resumed at --steps exactly: the saved open curve point is the last one
    count = step - (history[-1]["step"] if history else 0)
    history.append(dict(step=step, **{k: round(v / count, 5) for k, v in sums.items()}))
  sessions[-1]["end_step"] = step
  train_checks.check_finite(step, a.lr, params=trainer.state["ema"])
  ema = jax.device_get(trainer.state["ema"])
  held_out = x_test[:a.eval_images].astype(np.float32) / 127.5 - 1.0
  mse = eps_mse(trainer.model, ema, held_out, EVAL_TIMESTEPS, seed=a.seed)
  digest = checkpoint.params_digest(ema)
  record = dict(command=reproducing_command(argv), git_commit=sessions[-1]["git_commit"], sessions=sessions,
                unet=cfg.to_dict(), diffusion=DIFFUSION, seed=a.seed,
                steps=a.steps, batch_size=a.batch_size, lr=a.lr, weight_decay=0.0, ema_rate=a.ema_rate,
                train_images=len(x_train), epochs=round(a.steps / per_epoch, 4), n_params=n_params,
                history=history, held_out_eps_mse=dict(images=len(held_out), **{str(t): round(v, 5) for t, v in
                                                                              mse.items()}),
                train_seconds=round(seconds, 1), params_sha256=digest)
  meta = checkpoint.make_unet_meta(cfg, DIFFUSION, source="experiments/train_ddpm.py")
  meta["training"] = record
  tmp = f"{out}.tmp{os.getpid()}"
  checkpoint.save(tmp, ema, meta, force=True)
  files.write_json(os.path.join(tmp, "record.json"), record, indent=1)
  shutil.rmtree(out, ignore_errors=True)
  os.replace(tmp, out)
  print(json.dumps(dict(out=out, steps=a.steps, params_sha256=digest, final=history[-1] if history else None,
                        held_out_eps_mse=record["held_out_eps_mse"], seconds=round(seconds, 1))), flush=True)
  return 0
