"""Trains the built-in benchmark's source model: a small ViT on clean Fashion-MNIST.

    python experiments/train_source.py                       # regenerates assets/fmnist_vit
    python experiments/train_source.py --out /tmp/ckpt --epochs 1 --train-limit 2048   # a quick look

The model is the project's own `VisionTransformer` (timm layout) at 32x32 px;
training is AdamW with a linear warm-up and cosine decay, random horizontal
flips as the only augmentation, float32. The committed model (15 epochs,
53 min on a 2-core CPU) reaches 89.69% clean test accuracy; it overfits (train
loss 0.11) and two fixes tried did not help: random 2 px shifts hurt
from scratch (the issue's probe) and, as a 3-epoch low-lr fine-tune (lr 2e-4,
cosine; a variant of this script that was not kept), gave 89.21%. Patch 4 (4x the tokens) or a longer schedule are the known levers.
Everything is derived from ``--seed`` -- init, the epoch permutations and the
flips -- and runs with the highest matmul precision, so on a CPU the script
regenerates the committed checkpoint bit for bit (the saved metadata records
a SHA-256 of the params to check that against). A non-finite loss stops the run
at that step, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo

from pcsr_jax import files
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments import train_checks

DEFAULT_OUT = os.path.join(ROOT, "assets", "fmnist_vit")
# mean = std = 0.5, as for timm's augreg ViTs: the same preprocessing code serves both.
PREPROCESSING = dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="none", crop_pct=1.0)


def params_digest(params) -> str:
  """SHA-256 over the params' float32 bytes in pytree order (the bit-for-bit check)."""
  import jax
  import numpy as np

  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
  return h.hexdigest()


def normalize(images):
  """uint8 NHWC -> float32 in [-1, 1] (mean = std = 0.5)."""
  import jax.numpy as jnp

  return images.astype(jnp.float32) / 127.5 - 1.0


def train(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from pcsr_jax.data import fashion_mnist
  from pcsr_jax.models import ViTConfig, create, init_params

  jax.config.update("jax_default_matmul_precision", "highest")
  x_train, y_train = fashion_mnist.load("train", args.fashion_mnist_dir)
  x_test, y_test = fashion_mnist.load("test", args.fashion_mnist_dir)
  if args.train_limit:
    x_train, y_train = x_train[:args.train_limit], y_train[:args.train_limit]
  if len(x_train) < args.batch_size:
    raise UserError(f"--batch-size {args.batch_size}: more than the {len(x_train)} training images")
  cfg = ViTConfig(embed_dim=args.embed_dim, depth=args.depth, num_heads=args.num_heads, patch_size=args.patch_size,
                  img_size=fashion_mnist.IMG_SIZE, num_classes=len(fashion_mnist.CLASSES),
                  name=f"fmnist_vit_d{args.embed_dim}_l{args.depth}_p{args.patch_size}")
  model = create(cfg)
  params = init_params(model, jax.random.key(args.seed))
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  steps_per_epoch = len(x_train) // args.batch_size  # drop the ragged tail: one compiled shape

  @jax.jit
  def predict(params, images):
    return jnp.argmax(model.apply({"params": params}, normalize(images)), -1)

  def accuracy(params) -> float:
    preds = np.concatenate([np.asarray(predict(params, x_test[i:i + 1000])) for i in range(0, len(x_test), 1000)])
    return float((preds == y_test).mean())

  print(f"{cfg.name}: {n_params / 1e6:.2f}M params, {len(x_train)} train images, {args.epochs} epochs "
        f"x {steps_per_epoch} steps of {args.batch_size}", flush=True)
  rng = np.random.default_rng(args.seed)
  t0 = time.time()
  history = []

  total = steps_per_epoch * args.epochs
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(steps_per_epoch, total // 10 + 1), total)
  # No weight decay on biases, LayerNorm scales, the class token and pos_embed (the usual ViT recipe).
  decay_mask = jax.tree_util.tree_map_with_path(
      lambda p, v: v.ndim > 1 and "pos_embed" not in jax.tree_util.keystr(p), params)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(sched, b1=0.9, b2=0.999, weight_decay=args.weight_decay, mask=decay_mask))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, images, labels, flip):
    x = normalize(images)
    x = jnp.where(flip[:, None, None, None], x[:, :, ::-1], x)

    def loss_fn(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for epoch in range(args.epochs):
    perm = rng.permutation(len(x_train))
    flips = rng.random(len(x_train)) < 0.5
    losses = []
    done = epoch * steps_per_epoch  # steps before this epoch
    for s in range(steps_per_epoch):
      idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
      params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx], flips[idx])
      losses.append(loss)
      if s:  # the previous step's loss, read while this one runs
        train_checks.check_finite(done + s, args.lr, loss=float(losses[-2]))
    train_checks.check_finite(done + steps_per_epoch, args.lr, loss=float(losses[-1]), params=params)
    mean_loss = float(np.mean(jax.device_get(losses)))
    acc = accuracy(params) if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs else None
    history.append(dict(epoch=epoch + 1, loss=mean_loss, test_accuracy=acc))
    acc_s = f", clean test accuracy {100 * acc:.2f}%" if acc is not None else ""
    print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}{acc_s} ({time.time() - t0:.0f} s)", flush=True)
  return dict(cfg=cfg, params=jax.device_get(params), accuracy=history[-1]["test_accuracy"], history=history,
              n_params=n_params, train_images=len(x_train), seconds=time.time() - t0)


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="train_source.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=DEFAULT_OUT, help="checkpoint dir to write (default: assets/fmnist_vit)")
  p.add_argument("--force", action="store_true", help="overwrite --out")
  p.add_argument("--fashion-mnist-dir", help="dir with the idx(.gz) files (default: Debian's, then TFDS)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--epochs", type=int, default=15)
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--weight-decay", type=float, default=0.05)
  p.add_argument("--embed-dim", type=int, default=128)
  p.add_argument("--depth", type=int, default=6)
  p.add_argument("--num-heads", type=int, default=4)
  p.add_argument("--patch-size", type=int, default=8)
  p.add_argument("--train-limit", type=int, help="train on the first N images only (quick checks)")
  p.add_argument("--eval-every", type=int, default=5, help="test accuracy every N epochs (and at the end)")
  a = p.parse_args(argv)
  train_checks.check_flags(a, positive=("epochs", "batch_size", "embed_dim", "depth", "num_heads", "patch_size",
                                        "train_limit", "eval_every"), positive_floats=("lr",),
                           non_negative_floats=("weight_decay",))
  if 32 % a.patch_size or a.embed_dim % a.num_heads:
    raise UserError("--patch-size must divide 32 and --num-heads must divide --embed-dim")
  files.check_output_dir(a.out, "--out")
  if os.path.exists(a.out) and not a.force:
    raise UserError(f"{a.out}: exists (pass --force to overwrite)")

  from pcsr_jax import checkpoint

  r = train(a)
  digest = params_digest(r["params"])
  meta = checkpoint.make_meta(r["cfg"], PREPROCESSING, source="experiments/train_source.py")
  meta["training"] = dict(seed=a.seed, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, weight_decay=a.weight_decay,
                          train_images=r["train_images"], clean_test_accuracy=r["accuracy"],
                          history=r["history"], params_sha256=digest, n_params=r["n_params"])
  checkpoint.save(a.out, r["params"], meta, force=a.force)
  print(json.dumps(dict(out=a.out, clean_test_accuracy=r["accuracy"], params_sha256=digest,
                        n_params=r["n_params"], train_seconds=round(r["seconds"], 1))))
  return 0

