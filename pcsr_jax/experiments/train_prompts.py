"""DePT-G's source stage: prompts, head and DINO heads trained on clean source data for a checkpoint.

    python experiments/train_prompts.py --checkpoint CKPT --source-data SRC --out DIR
    python experiments/train_prompts.py ... --resume          # continue an interrupted run where it stopped

``--source-data`` takes what the harness takes (a clean ImageNet folder ``<dir>/<wnid>/*.JPEG``,
``tfds[:<name>[:<split>]]`` or ``fmnist-train``), with labels in the checkpoint's classes. ``DIR`` then holds
``params.npz`` and ``record.json`` (the SHA-256 of the checkpoint's params they were trained from, the
command, the settings, the training curve and the names of the unreadable source images, which are left out
of their batches as the harness leaves them out of its stream), which ``dept-g`` reads: ``--method-args
'{"dept-g": {"prompts": "DIR"}}'``. A non-finite loss stops the run with nothing written as finished.

What it runs (``yhygao/DePT:source.py``, ``script/source/train_imagenet-c_source.sh``, ``losses.py``,
``model/dept_dino.py``): per step, a teacher EMA (momentum 0.99) of the student, then the teacher on one
global crop and the student on another (``RandomResizedCrop(scale (0.6, 1))``, flip, colour jitter p 0.8,
greyscale p 0.2, blur p 0.5); loss = label-smoothed CE (0.1) of the student's logits + 0.1 DINO-CLS (teacher
temperature 0.04 -> 0.07 linearly over the first 3 epochs, then 0.07; student 0.1; a center with momentum 0.9)
+ 0.1 stage-weighted prompt cosine consistency + 0.005 prompt diversity; SGD Nesterov 0.9, weight decay 1e-4,
lr 5e-4 for the backbone and x10 for prompts, head and DINO heads, linear warm-up over 200 steps
(``warmup_iters = stages * prompts``) then cosine to 0; batch 128, 5 epochs; 4 stages x 50 prompts,
xavier-uniform; DINO heads of 2 layers, 2048 hidden, 256 bottleneck, 2048 out, one per stage.

Departures, each stated: the backbone is frozen by default (``--finetune-backbone`` for the official recipe,
which fine-tunes all of it): every method of a table must adapt the same source model, and with a frozen
backbone only the prompts, head and DINO heads are new. Frozen, the prompts keep the official recipe's x10
learning rate (the official ``tune_type='prompt'`` gives them 1x; its scripts never run it). The crops
are taken from the harness's preprocessed source image (ImageNet: Resize 256 + CenterCrop 224; the official
crops the full-size JPEG) and resampled bilinearly (the official: bicubic). The teacher's prompts and DINO
heads start from their own random init, as the official builds the teacher as a second model; the last ragged
batch of an epoch is dropped (one compiled shape). ``--steps`` caps the run (the schedule is then that long).

Cost at the official settings (estimate, not measured): about 44 GFLOP per ViT-B/16 forward with 50 prompt
tokens, 3-4 forward-equivalents per image (teacher and student forwards, the student's backward), 5 epochs of
1.28M images: about 1e18 FLOP, a few hours of one H200 at TF32 rates if the input pipeline keeps up with 6.4M
JPEG decodes. Deterministic under ``--seed`` (init, epoch orders and views),
resumable bit for bit from the state saved every ``--checkpoint-every`` steps (``DIR/resume``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from typing import Any, Optional, Sequence

from pcsr_jax import files
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments import train_checks

FORMAT_STATE = "pcsr-jax dept-g train_prompts state v1"


def parse(argv: Optional[Sequence[str]]):
  p = ArgumentParser(prog="train_prompts.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True, help="the source model (a folder of convert_weights.py or train_source.py)")
  p.add_argument("--source-data", required=True,
                 help="clean labelled source images: a folder <dir>/<wnid>/*, tfds[:<name>[:<split>]], fmnist-train")
  p.add_argument("--out", required=True, help="folder to write params.npz and record.json to")
  p.add_argument("--resume", action="store_true", help="continue the run saved in --out/resume")
  p.add_argument("--force", action="store_true", help="overwrite a finished --out")
  p.add_argument("--finetune-backbone", action="store_true",
                 help="train the whole backbone too (the official recipe; breaks 'one source model per table')")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--epochs", type=int, default=5)
  p.add_argument("--steps", type=int, help="stop the schedule after this many steps (default: all epochs)")
  p.add_argument("--stop-after", type=int, help="save and stop after this many steps (resume later with --resume)")
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--lr", type=float, default=5e-4, help="backbone lr; prompts, head and DINO heads get x10")
  p.add_argument("--warmup-steps", type=int, help="linear lr warm-up (default: stages x prompts, the scripts' 200)")
  p.add_argument("--stages", type=int, default=4)
  p.add_argument("--prompts", type=int, default=50, help="prompts per stage")
  p.add_argument("--dino-layers", type=int, default=2)
  p.add_argument("--dino-hidden", type=int, default=2048)
  p.add_argument("--dino-bottleneck", type=int, default=256)
  p.add_argument("--dino-out", type=int, default=2048)
  p.add_argument("--images", type=int, help="use the first N source images only")
  p.add_argument("--checkpoint-every", type=int, default=200, help="save the state for --resume every N steps")
  p.add_argument("--workers", type=int, help="image decoding threads")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  a = p.parse_args(argv)
  train_checks.check_flags(a, positive=("epochs", "batch_size", "checkpoint_every", "steps", "stop_after", "images",
                                        "workers"), non_negative=("warmup_steps",), positive_floats=("lr",))
  return a


class Settings:
  """The official source-stage constants (``train_imagenet-c_source.sh``; see the module docstring)."""

  momentum = 0.9
  weight_decay = 1e-4
  extra_lr_factor = 10.0
  ema = 0.99
  label_smoothing = 0.1
  beta, beta2, lam = 0.1, 0.1, 0.005  # DINO-CLS, prompt consistency, prompt diversity
  teacher_init_temp, teacher_temp, teacher_warmup_epochs = 0.04, 0.07, 3
  student_temp = 0.1
  center_momentum = 0.9
  tau = 1.0
  crop_scale = (0.6, 1.0)


def teacher_temperature(epoch: int, epochs: int) -> float:
  """``DINOLoss.teacher_temp_schedule[epoch]``: linspace(0.04, 0.07, 3) over the first 3 epochs, then 0.07."""
  s = Settings
  sched = [s.teacher_init_temp + (s.teacher_temp - s.teacher_init_temp) * i / (s.teacher_warmup_epochs - 1)
           for i in range(s.teacher_warmup_epochs)] + [s.teacher_temp] * max(0, epochs - s.teacher_warmup_epochs)
  return float(sched[min(epoch, len(sched) - 1)])


def lr_decay(step, warmup: int, total: int):
  """``utils.adjust_learning_rate`` with ``lr_decay='cos'``: step / warmup, then a cosine from 1 to 0."""
  import jax.numpy as jnp

  step = jnp.asarray(step, jnp.float32)
  warm = step / max(warmup, 1)
  cos = 0.5 * (1.0 + jnp.cos(jnp.pi * (step - warmup) / max(total - warmup, 1)))
  return jnp.where(step < warmup, warm, cos)


def source_loss(model, frozen, student, teacher, center, teacher_view, student_view, labels, valid, temp):
  """``(loss, (parts, teacher DINO-CLS output))`` of one source step on given normalised views (``source.py``
  ``train_epoch``): the teacher (already EMA-updated; ``teacher`` and ``student`` are the trainable params
  over ``frozen``) on ``teacher_view``, the student on ``student_view``; label-smoothed CE + ``beta``
  DINO-CLS (teacher temperature ``temp``) + ``beta2`` prompt consistency + ``lam`` prompt diversity."""
  import jax
  import jax.numpy as jnp

  from pcsr_jax.methods import dept
  from pcsr_jax.methods.base import merge

  s = Settings
  w = valid.astype(jnp.float32)
  weights = dept.stage_weights(model.prompt.stages, s.tau)
  num_classes = model.config.num_classes
  _, _, t_cls, t_prompt, _ = dept.dino_forward(model, merge(frozen, teacher), teacher_view)
  _, logits, s_cls, s_prompt, s_dist = dept.dino_forward(model, merge(frozen, student), student_view)
  target = jax.nn.one_hot(labels, num_classes) * (1 - s.label_smoothing) + s.label_smoothing / num_classes
  ce = dept.masked_mean(-jnp.sum(target * jax.nn.log_softmax(logits), axis=-1), w)
  dino = dept.dino_cls_loss(s_cls, t_cls, center, temp, s.student_temp, w)
  cons = dept.prompt_consistency(s_prompt, t_prompt, weights, w)
  div = dept.prompt_diversity(s_dist, weights, w)
  acc = dept.masked_mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32), w)
  parts = dict(ce=ce, dino_cls=dino, prompt=cons, prompt_div=div, accuracy=acc)
  return ce + s.beta * dino + s.beta2 * cons + s.lam * div, (parts, jax.lax.stop_gradient(t_cls))


class Trainer:
  """The source stage's model, optimizer and compiled step (`train` drives it; tests drive it directly)."""

  def __init__(self, model, params, prompt, *, finetune: bool, lr: float, warmup: int, total: int, seed: int,
               epochs: int, mean, std):
    import jax
    import jax.numpy as jnp
    import optax

    from pcsr_jax.methods import dept
    from pcsr_jax.methods.base import split
    from pcsr_jax.models import prompted

    self.prompt, self.epochs, self.mean, self.std = prompt, epochs, tuple(mean), tuple(std)
    self.pm = pm = prompted.create(model, prompt)
    key = jax.random.key(seed)
    student_extra = prompted.init_extra(pm, jax.random.fold_in(key, 0))
    teacher_extra = prompted.init_extra(pm, jax.random.fold_in(key, 1))  # the teacher is a second model
    self.data_key = jax.random.fold_in(key, 2)
    self.is_trainable = (lambda path: True) if finetune else (lambda path: prompted.is_extra(path) or path[0] == "head")
    self.frozen, trainable = split(dict(params, **student_extra), self.is_trainable)
    _, teacher = split(dict(params, **teacher_extra), self.is_trainable)
    s = Settings
    group = lambda path: "extra" if prompted.is_extra(path) or path[0] == "head" else "backbone"
    labels = lambda tree: jax.tree_util.tree_map_with_path(lambda kp, _: group(tuple(k.key for k in kp)), tree)
    sgd = lambda base: optax.sgd(lambda step: base * lr_decay(step, warmup, total), momentum=s.momentum,
                                 nesterov=True)
    self.tx = optax.chain(optax.add_decayed_weights(s.weight_decay),
                          optax.multi_transform({"backbone": sgd(lr), "extra": sgd(lr * s.extra_lr_factor)}, labels))
    self.state = dict(student=trainable, teacher=teacher, opt=self.tx.init(trainable),
                      center=jnp.zeros((prompt.dino_out,), jnp.float32), step=jnp.zeros((), jnp.int32))
    frozen = self.frozen

    def step(frozen, state, images, labels, valid, temp):
      from pcsr_jax import augment

      k1, k2 = jax.random.split(jax.random.fold_in(self.data_key, state["step"]))
      x01 = augment.denormalize(images, self.mean, self.std)
      view = lambda k: augment.normalize(augment.dept_strong(k, x01, s.crop_scale), self.mean, self.std)
      teacher = jax.tree.map(lambda t, p: t * s.ema + p * (1.0 - s.ema), state["teacher"], state["student"])
      loss_fn = lambda student: source_loss(pm, frozen, student, teacher, state["center"], view(k1), view(k2),
                                            labels, valid, temp)
      (loss, (parts, t_cls)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["student"])
      updates, opt = self.tx.update(grads, state["opt"], state["student"])
      new = dict(student=optax.apply_updates(state["student"], updates), teacher=teacher, opt=opt,
                 center=dept.new_center(state["center"], t_cls, valid.astype(jnp.float32), s.center_momentum),
                 step=state["step"] + 1)
      return new, dict(parts, loss=loss)

    self._step = jax.jit(step, donate_argnums=(1,))
    self._frozen = jax.device_put(frozen)

  def step(self, images, labels, valid, epoch: int) -> dict:
    """One step on normalised images ``[B, H, W, C]`` (rows with ``valid`` False are padding)."""
    self.state, metrics = self._step(self._frozen, self.state, images, labels, valid,
                                     teacher_temperature(epoch, self.epochs))
    return metrics

  def student_params(self) -> Any:
    """What ``dept-g`` reads: the trained prompts, DINO heads and head (and the backbone, when fine-tuned)."""
    import jax

    return jax.device_get(self.state["student"])

  def host_state(self) -> Any:
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, jax.device_get(self.state))

  def load_state(self, tree: Any) -> None:
    import jax
    import jax.numpy as jnp

    self.state = jax.tree.map(jnp.asarray, tree)



def first_readable_shape(loader, n: int, spec: str) -> tuple:
  """The shape of the first readable one of the source's first ``n`` images (what the padding rows of a batch
  take when all its images are unreadable); a one-line `UserError` naming ``spec`` when none can be read.
  Decodes the images in the loader's batches until one comes back: one batch unless many are unreadable."""
  import numpy as np

  skipped: list = []
  batches = loader.batches(np.zeros(n, np.int64), np.arange(n))
  try:
    for b in batches:
      if len(b.labels):
        return tuple(b.images.shape[1:])
      skipped += b.skipped
  finally:
    batches.close()
  raise UserError(f"--source-data {spec}: none of the {n:,} source images could be read (e.g. "
                  f"{', '.join(skipped[:3])})")


def run_key(a, ckpt_digest: str, data_desc: str, n_images: int) -> str:
  """What a resumed run must share with the saved one: every setting that changes the numbers."""
  keep = {k: v for k, v in vars(a).items() if k not in ("resume", "force", "stop_after", "checkpoint_every",
                                                      "workers", "no_progress", "out")}
  blob = json.dumps(dict(keep, checkpoint=ckpt_digest, data=data_desc, images=n_images), sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def main(argv: Optional[Sequence[str]] = None) -> int:
  a = parse(argv)
  out = a.out
  files.check_output_dir(out, "--out")
  if os.path.exists(os.path.join(out, "record.json")) and not (a.force or a.resume):
    raise UserError(f"--out {out}: holds trained prompts already (pass --force to overwrite)")
  resume_dir = os.path.join(out, "resume")
  if a.resume and not os.path.isfile(os.path.join(resume_dir, "state.json")):
    raise UserError(f"--resume: no saved progress in {resume_dir}")

  import jax
  import numpy as np
  from tqdm import tqdm

  from pcsr_jax import checkpoint, source_stats
  from pcsr_jax.data import sources
  from pcsr_jax.data.loader import Loader
  from pcsr_jax.methods import dept
  from pcsr_jax.models import prompted

  jax.config.update("jax_default_matmul_precision", "highest")
  source_stats.check_spec(a.source_data)
  model, params, meta = checkpoint.load(a.checkpoint, kind="vit")
  prompt = prompted.PromptConfig(stages=a.stages, prompts=a.prompts, dino_layers=a.dino_layers,
                                 dino_hidden=a.dino_hidden, dino_bottleneck=a.dino_bottleneck, dino_out=a.dino_out)
  prompt.check(model.config.depth, "--stages/--prompts/--dino-*:")
  data = source_stats.open_source_data(a.source_data, meta)
  sources.check_classes(data.source, model.config.num_classes, None, f"--source-data {a.source_data}")
  n = len(data.source) if a.images is None else min(a.images, len(data.source))
  per_epoch = n // a.batch_size
  if per_epoch < 1:
    raise UserError(f"--batch-size {a.batch_size}: more than the {n} source images")
  total = per_epoch * a.epochs if a.steps is None else min(a.steps, per_epoch * a.epochs)
  loader = Loader([data.source], data.preprocess.to_uint8, a.batch_size, workers=a.workers)
  image_shape = first_readable_shape(loader, n, a.source_data)
  warmup = a.stages * a.prompts if a.warmup_steps is None else a.warmup_steps
  ckpt_digest = checkpoint.params_digest(params)
  key = run_key(a, ckpt_digest, data.description, n)
  trainer = Trainer(model, params, prompt, finetune=a.finetune_backbone, lr=a.lr, warmup=warmup, total=total,
                    seed=a.seed, epochs=a.epochs, mean=meta["mean"], std=meta["std"])
  history: list = []
  start, unreadable = 0, set()  # unreadable: the names of the source images skipped so far (over all sessions)
  if a.resume:
    saved = files.load_trainer(resume_dir, trainer, FORMAT_STATE)
    if saved.get("key") != key:
      raise UserError(f"--resume: {resume_dir} was saved by a run with other settings, checkpoint or data; rerun "
                      f"without --resume to start over")
    start, history = int(saved["step"]), saved.get("history", [])
    unreadable = set(saved.get("unreadable", []))
  elif os.path.isdir(resume_dir):
    shutil.rmtree(resume_dir)
  print(f"dept-g source stage: {data.description}, {n:,} images, {total} steps of {a.batch_size} "
        f"({total / per_epoch:.2f} epochs), backbone {'fine-tuned' if a.finetune_backbone else 'frozen'}, "
        f"{prompt.stages} stages x {prompt.prompts} prompts" + (f"; resuming at step {start}" if start else ""),
        flush=True)
  bar = tqdm(total=total, initial=start, desc="dept-g prompts", unit="step",
             disable=a.no_progress or not sys.stderr.isatty(), file=sys.stderr)
  t0, step, sums = time.time(), start, {}
  stop = total if a.stop_after is None else min(total, start + a.stop_after)
  try:
    while step < stop:
      epoch, first = divmod(step, per_epoch)
      order = np.random.default_rng([a.seed, epoch]).permutation(n)[:per_epoch * a.batch_size]
      for b in loader.batches(np.zeros(len(order), np.int64), order, start_batch=first):
        # Unreadable images are left out as padding rows (valid False); a batch of none readable is all padding
        # and still a step, so that the schedule and the resumable step count stay those of the batch order.
        rows = len(b.labels)
        unreadable.update(b.skipped)
        images = np.zeros((a.batch_size,) + image_shape, np.float32)
        if rows:
          images[:rows] = data.preprocess.normalize(b.images)
        labels = np.zeros((a.batch_size,), np.int32)
        labels[:rows] = b.labels
        metrics = trainer.step(images, labels, np.arange(a.batch_size) < rows, epoch)
        step += 1
        bar.update(1)
        values = {k: float(v) for k, v in metrics.items()}
        train_checks.check_finite(step, a.lr, loss=values["loss"])
        for k, v in values.items():
          sums[k] = sums.get(k, 0.0) + v
        if step % a.checkpoint_every == 0 or step == stop or step % per_epoch == 0:
          count = step - (history[-1]["step"] if history else 0)
          history.append(dict(step=step, epoch=epoch, **{k: round(v / max(count, 1), 5) for k, v in sums.items()}))
          sums = {}
          bar.set_postfix(loss=history[-1]["loss"], acc=history[-1]["accuracy"])
          train_checks.check_finite(step, a.lr, params=trainer.state["student"])
          files.save_trainer(resume_dir, trainer, FORMAT_STATE, dict(key=key, step=step, history=history,
                                                                     unreadable=sorted(unreadable)))
        if step >= stop or step % per_epoch == 0:
          break
  finally:
    bar.close()
  seconds = time.time() - t0
  if unreadable:
    print(f"skipped {len(unreadable)} unreadable source images of {n:,} (named in "
          f"{os.path.join(out, 'record.json' if step >= total else 'resume/state.json')})", flush=True)
  if step < total:
    print(f"stopped after step {step} of {total} ({seconds:.0f} s); continue with --resume", flush=True)
    return 0
  command = "python experiments/train_prompts.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                       else sys.argv[1:]))
  record = dict(checkpoint_sha256=ckpt_digest, checkpoint=a.checkpoint, source_data=data.description,
                source_images=n, command=command, seed=a.seed, steps=total, epochs=round(total / per_epoch, 4),
                batch_size=a.batch_size, lr=a.lr, warmup_steps=warmup, finetune_backbone=a.finetune_backbone,
                unreadable_images=len(unreadable), unreadable=sorted(unreadable), history=history,
                seconds_this_session=round(seconds, 1))
  digest = dept.save_prompts(out, trainer.student_params(), prompt, record)
  shutil.rmtree(resume_dir, ignore_errors=True)
  print(json.dumps(dict(out=out, steps=total, params_npz_sha256=digest, final=history[-1] if history else None,
                        seconds=round(seconds, 1))), flush=True)
  return 0
