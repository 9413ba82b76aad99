"""Main job: online test-time adaptation on ImageNet-C, printing the paper's Table 1 layout.

    python experiments/imagenet_c.py --data /data/imagenet-c --checkpoint ckpt/vit_b16 \
        --methods source,tent,sar,pcsr --corruptions all --severity 5 --seeds 2022,2023,2024 \
        --setting normal --batch-size 64 --output runs/table1

Presets (``--preset``): ``table1`` (ViT-B/16, severity 5), ``level3`` (severity 3),
``vit_large`` (ViT-L/16 with PCSR's 0.05 / 0.0001 learning rates).

Without ``--data`` it runs the built-in benchmark: Source, TENT, SAR and PCSR
on Fashion-MNIST-C (real Fashion-MNIST test images, the 15 corruptions at
CIFAR-10-C strength, severity 5) with the committed source ViT
(``assets/fmnist_vit``) -- 1,280 images per corruption and one seed in under
5 minutes on a 2-core CPU, or ``--full`` (10,000 images, 3 seeds). A run with ``dda`` defaults to 64 images per
corruption and fewer diffusion steps than the official (about ten minutes; ``--full``: the official steps).
``--eval-order both`` runs every method twice, predicting before and after its
update, and prints the two side by side.
"""

from __future__ import annotations

import os
from typing import Sequence

from pcsr_jax import methods
from pcsr_jax.experiments import common
from pcsr_jax.methods.pcsr import PCSR

PRESETS = {
    # Every method that exists (the paper's Table 1 rows we have, and the strongest ViT baselines since).
    # CFA and FOA need --source-data (ImageNet train with labels for CFA, val for FOA; EATA's Fisher: val);
    # DePT-G its source-stage prompts: --method-args '{"dept-g": {"prompts": DIR}}' (experiments/train_prompts.py).
    "table1": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                   methods=tuple(methods.REGISTRY)),
    "level3": dict(severity=3, setting="normal", batch_size=64, seeds=(2022, 2023, 2024)),
    "vit_large": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                      method_args={m: PCSR.lrs("vit_large") for m in ("pcsr", "pcsr-frozen")}),
}


def _given(value, default):
  """A number flag's value, or ``default`` where it was not given: 0 is a value (the harness rejects it), not
  "unset", as a falsy ``or`` would read it."""
  return default if value is None else value


def builtin_run(a) -> int:
  """No --data: the built-in Fashion-MNIST-C benchmark (see pcsr_jax/experiments/builtin.py)."""
  import time

  from pcsr_jax.experiments import builtin
  from pcsr_jax import ccc_stream, checkpoint, distributed, harness
  from pcsr_jax.data import corruptions
  from pcsr_jax.errors import UserError

  t0 = time.time()
  batch, severity = _given(a.batch_size, builtin.BATCH_SIZE), _given(a.severity, builtin.SEVERITY)
  say = print if distributed.is_main() else lambda *a, **k: None  # multi-process: process 0 speaks
  for flag in ("dataset", "tfds_data_dir", "image_list", "label_shift_indices"):
    if getattr(a, flag) is not None:
      raise UserError(f"--{flag.replace('_', '-')} needs --data (it does not apply to the built-in benchmark)")
  if a.preset not in (None, "table1"):
    raise UserError(f"--preset {a.preset} needs --data (the built-in benchmark has only table1: every method)")
  if a.full and a.images is not None:
    raise UserError("--full runs all 10,000 images: drop --images")
  ckpt = a.checkpoint or builtin.CHECKPOINT
  meta = checkpoint.load_meta(ckpt, kind="vit")
  seeds = common.parse_seeds(a.seeds) if a.seeds else (builtin.FULL_SEEDS if a.full else builtin.DEFAULT_SEEDS)
  corr = common.parse_corruptions(a.corruptions) if a.corruptions else corruptions.BENCHMARK
  # The default five fit the 5-minute budget; --full and --preset table1 run every registered method.
  chosen = (common.parse_methods(a.methods) if a.methods else
            builtin.all_methods() if a.full or a.preset == "table1" else builtin.METHODS)
  # A slow method (DDA) lowers the default image count: builtin.METHOD_IMAGES.
  images = builtin.FULL_IMAGES if a.full else _given(a.images, builtin.default_images(chosen))
  out = a.output or os.path.join("runs", "builtin_full" if a.full else "builtin")
  orders = ("before", "after") if a.eval_order == "both" else (a.eval_order,)
  acc = meta.get("training", {}).get("clean_test_accuracy")
  if a.setting == "ccc":  # one walk over the test images (pcsr_jax.ccc_stream)
    length = _given(a.ccc_length, ccc_stream.BUILTIN_LENGTH_CORRUPTIONS * images)
    what = (f"CCC's walk of {length:,} images drawn from the 10,000 test images, target "
            f"{_given(a.ccc_target, harness.RunConfig.ccc_target):g}%, walk seed "
            f"{_given(a.corruption_seed, harness.RunConfig.corruption_seed)}")
  else:
    what = (f"{'severities 1..5..1' if a.setting == 'gradual' else f'severity {severity}'}; {images:,} images per "
            f"corruption (the first {images:,} of the 10,000 test images), {len(corr)} corruptions")
  say(f"no --data: built-in benchmark, Fashion-MNIST-C (real Fashion-MNIST test images, CIFAR-10-C-strength "
        f"corruptions), setting {a.setting or 'normal'}: {what}; seeds {','.join(map(str, seeds))}, batch {batch}; "
        f"source model {ckpt}" + (f" (clean test accuracy {100 * acc:.2f}%)" if acc is not None else "") +
        (f"; {images} images per corruption because {', '.join(m for m in chosen if m in builtin.METHOD_IMAGES)} "
         f"is slow (--images to change)" if not a.full and a.images is None and images < builtin.DEFAULT_IMAGES
         else ""), flush=True)
  results = {}
  for order in orders:
    # --eval-order both: a method that predicts only before its update (T3A, FOA, ...) runs in that pass only.
    these = tuple(m for m in chosen if len(orders) == 1 or order in methods.get(m).eval_orders)
    cfg = builtin.run_config(
        os.path.join(out, f"eval_{order}") if len(orders) > 1 else out, images=images, seeds=seeds, methods=these,
        corruptions=corr, severity=severity, eval_order=order, full=a.full,
        method_args=common.parse_method_args(a.method_args), checkpoint=ckpt, setting=a.setting or "normal",
        batch_size=batch, fmnist_dir=a.fashion_mnist_dir, cache_dir=a.cache_dir,
        shuffle=not a.no_shuffle, save_predictions=a.save_predictions, resume=a.resume,
        checkpoint_every=_given(a.checkpoint_every, 50), workers=a.workers, progress=not a.no_progress,
        source_data=a.source_data, source_images=a.source_images, dtype=a.dtype or "float32",
        attention=a.attention or "matmul", loader=a.loader or "auto", row_chunk=a.row_chunk,
        **{k: getattr(a, k) for k in ("corruption_seed", "ccc_target", "ccc_speed", "ccc_length",
                                      "ccc_calibration_images") if getattr(a, k) is not None})
    if len(orders) > 1:
      say(f"--- eval order: {order} (every method predicts {order} its update) ---", flush=True)
    results[order] = harness.run(cfg)
  if len(orders) > 1:
    say(common.eval_order_table(results, chosen))
  say(f"built-in benchmark done in {time.time() - t0:.0f} s; outputs in {out}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  p = common.parser("imagenet_c.py", __doc__.split("\n\n")[0], PRESETS)
  g = p.add_argument_group("built-in benchmark (no --data)")
  g.add_argument("--full", action="store_true", help="all 10,000 test images per corruption, 3 seeds")
  g.add_argument("--images", type=int, help="images per corruption (default 1280; 64 when dda runs)")
  g.add_argument("--fashion-mnist-dir", help="dir with Fashion-MNIST's idx(.gz) files (default: Debian's)")
  g.add_argument("--cache-dir", help="where Fashion-MNIST-C is cached (default: ~/.cache/pcsr-jax)")
  a = p.parse_args(argv)
  common.start_devices(a)
  if a.data is None and a.clean_data is None:
    return builtin_run(a)
  if a.eval_order == "both":
    raise common.UserError("--eval-order both: only for the built-in benchmark (no --data)")
  from pcsr_jax import harness

  harness.run(common.config_from_args(a, PRESETS))
  return 0

