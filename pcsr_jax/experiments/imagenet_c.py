"""Main job: online test-time adaptation on ImageNet-C, printing the paper's Table 1 layout.

    python experiments/imagenet_c.py --data /data/imagenet-c --checkpoint ckpt/vit_b16 \
        --methods source,tent,sar,pcsr --corruptions all --severity 5 --seeds 2022,2023,2024 \
        --setting normal --batch-size 64 --output runs/table1

Presets (``--preset``): ``table1`` (ViT-B/16, severity 5), ``level3`` (severity 3), ``continual`` (the
continual methods' protocol), ``vit_large`` (ViT-L/16 with PCSR's 0.05 / 0.0001 learning rates).

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
import sys
from typing import Sequence

from pcsr_jax import method_names
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import common

# PCSR's paper learning rates for ViT-L/16 (`PCSR.lrs('vit_large')`, kept equal by tests/test_methods.py): written
# out so that this module, which parses the flags, imports neither jax nor the methods.
VIT_LARGE_LRS = dict(lr_dsn=0.05, lr_fgn=0.0001)

PRESETS = {
    # Every method that exists (the paper's Table 1 rows we have, and the strongest ViT baselines since).
    # CFA and FOA need --source-data (ImageNet train with labels for CFA, val for FOA; EATA's Fisher: val);
    # DePT-G its source-stage prompts: --method-args '{"dept-g": {"prompts": DIR}}' (experiments/train_prompts.py).
    "table1": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                   methods=method_names.NAMES),
    "level3": dict(severity=3, setting="normal", batch_size=64, seeds=(2022, 2023, 2024)),
    # The continual protocol of CoTTA, DPCore and REM: the 15 corruptions in a row, reset once at the start.
    # Their papers report error rates on 5,000 images per corruption (RobustBench's); this runs every image.
    # DPCore needs --source-data (its code reads ImageNet train for its source statistics; EATA's Fisher: val).
    "continual": dict(severity=5, setting="continual", batch_size=64, seeds=(2022, 2023, 2024),
                      methods=("source", "tent", "cotta", "eata", "sar", "rem", "dpcore", "pcsr")),
    "vit_large": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                      method_args={m: dict(VIT_LARGE_LRS) for m in ("pcsr", "pcsr-frozen")}),
}
# What each preset but table1 is for, and its nearest form on the built-in benchmark (`check_preset`).
PRESET_NEEDS = {
    "level3": ("ImageNet-C at severity 3", "--severity 3"),
    "continual": ("the continual methods' ImageNet-C protocol (the 15 corruptions in a row, reset once)",
                  "--setting continual"),
    "vit_large": ("PCSR's learning rates for a ViT-L/16 --checkpoint on ImageNet-C", None),
}


def check_preset(a) -> None:
  """The built-in benchmark (no --data) runs only --preset table1: a plain one-line refusal of the others that
  says what they are for and what they need."""
  if not common.is_builtin(a) or a.preset in (None, "table1"):
    return
  what, here = PRESET_NEEDS[a.preset]
  raise UserError(f"--preset {a.preset}: {what}; it needs --data or --clean-data with --checkpoint. Without "
                  f"--data (the built-in benchmark) the one preset is table1 (every method)"
                  + (f"; for this setting on the built-in benchmark, give {here} instead" if here else ""))


def builtin_run(a) -> int:
  """No --data: the built-in Fashion-MNIST-C benchmark (see pcsr_jax/experiments/builtin.py)."""
  import time

  from pcsr_jax import distributed, files, lock, runlog

  t0 = time.time()
  cfg = configs(a)[""]
  if not distributed.is_main():
    return _builtin_runs(a, cfg, t0, lambda *a, **k: None)
  with lock.hold(cfg.output, " ".join(sys.argv)):  # before the header goes into log.txt: one run per folder
    # What this command writes beside its runs' own outputs (`harness.OUTPUT_NAMES`): never through a link.
    files.refuse_links(cfg.output, (runlog.LOG_FILE, "eval_before", "eval_after"))
    # Process 0 speaks, into <output>/log.txt too (the runs' own lines join it).
    return _builtin_runs(a, cfg, t0, runlog.Log(cfg.output, cfg.resume))


def _builtin_runs(a, cfg, t0: float, say) -> int:
  """The built-in benchmark's header, its run (or one per eval order) and its closing line."""
  import dataclasses
  import time

  from pcsr_jax import checkpoint, harness, methods

  acc = checkpoint.load_meta(cfg.checkpoint, kind="vit").get("training", {}).get("clean_test_accuracy")
  seeds = f"seed{'s' if len(cfg.seeds) > 1 else ''} {','.join(map(str, cfg.seeds))}"
  say(f"no --data: built-in benchmark, Fashion-MNIST-C (real Fashion-MNIST test images, CIFAR-10-C-strength "
      f"corruptions), {_describe(cfg, a)}; {seeds}, batch {cfg.batch_size}; source model {cfg.checkpoint}"
      + (f" (clean test accuracy {100 * acc:.2f}%)" if acc is not None else ""), flush=True)
  orders = ("before", "after") if a.eval_order == "both" else (cfg.eval_order,)
  results = {}
  for order in orders:
    # --eval-order both: a method that predicts only before its update (T3A, FOA, ...) runs in that pass only.
    run = cfg if len(orders) == 1 else dataclasses.replace(
        cfg, output=os.path.join(cfg.output, f"eval_{order}"), eval_order=order,
        methods=tuple(m for m in cfg.methods if order in methods.get(m).eval_orders))
    if len(orders) > 1:
      say(f"--- eval order: {order} (every method predicts {order} its update) ---", flush=True)
    results[order] = harness.run(run, log=say if len(orders) == 1 else print)
  if len(orders) > 1:
    say(common.eval_order_table(results, cfg.methods))
  say(f"built-in benchmark done in {time.time() - t0:.0f} s; outputs in {cfg.output}")
  return 0


def _describe(cfg, a) -> str:
  """The built-in run's stream, for its first line."""
  from pcsr_jax import ccc_stream
  from pcsr_jax.experiments import builtin
  from pcsr_jax.runlog import plural

  images = cfg.images_per_corruption
  if cfg.setting == "ccc":  # one walk over the test images (pcsr_jax.ccc_stream)
    return (f"setting ccc: CCC's walk of {ccc_stream.default_length(cfg):,} images drawn from the 10,000 test "
            f"images, target {cfg.ccc_target:g}%, walk seed {cfg.corruption_seed}")
  what = (f"setting {cfg.setting}: {'severities 1..5..1' if cfg.setting == 'gradual' else f'severity {cfg.severity}'}"
          f"; {images:,} images per corruption (the first {images:,} of the 10,000 test images)"
          + (f", at most {cfg.limit:,} of them each" if cfg.limit else "") + ", "
          + plural(len(cfg.corruptions), "corruption"))
  slow = [m for m in cfg.methods if m in builtin.METHOD_IMAGES]
  if not a.full and a.images is None and images < builtin.DEFAULT_IMAGES and slow:
    what += f"; {images} images per corruption because {', '.join(slow)} is slow (--images to change)"
  return what


def parser() -> common.ArgumentParser:
  p = common.parser("imagenet_c.py", __doc__.split("\n\n")[0], PRESETS)
  g = p.add_argument_group("built-in benchmark (no --data)")
  g.add_argument("--full", action="store_true", help="all 10,000 test images per corruption, 3 seeds")
  g.add_argument("--images", type=int, help="images per corruption (default 1280; 64 when dda runs)")
  g.add_argument("--fashion-mnist-dir", help="dir with Fashion-MNIST's idx(.gz) files (default: Debian's)")
  g.add_argument("--cache-dir", help="where Fashion-MNIST-C is cached (default: ~/.cache/pcsr-jax)")
  return p


def configs(a) -> dict:
  """``{row: RunConfig}`` of the flags (`common.config_from_args`): one run."""
  check_preset(a)
  return {"": common.config_from_args(a, PRESETS)[0]}


def main(argv: Sequence[str] | None = None) -> int:
  a = parser().parse_args(argv)
  check_preset(a)
  common.start_devices(a)
  if common.is_builtin(a):
    return builtin_run(a)
  from pcsr_jax import harness

  harness.run(configs(a)[""])
  return 0
