"""Computes the source statistics of the methods that need them, once, ahead of the runs that use them.

    python experiments/source_stats.py --checkpoint ckpt/vit_b16 --source-data /data/imagenet/val \\
        --methods eata,cfa,foa

Each method's statistics (EATA: Fisher information over 2,000 random clean images; CFA: feature moments per
class, with labels; FOA: CLS feature mean/std of every layer) go to ``<checkpoint>.source_stats/``, keyed by
checkpoint, images and method, with a checksum; runs with the same ``--source-data`` then load them. The
published numbers use ImageNet *val* for EATA and FOA and ImageNet *train* (with labels) for CFA: pass the
matching folder per method, or accept the substitute and report it (the run's records name the data used).
"""

from __future__ import annotations

from typing import Sequence

from pcsr_jax import checkpoint, methods, source_stats
from pcsr_jax.errors import ArgumentParser, UserError
from pcsr_jax.experiments import common


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="source_stats.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True, help="a converted checkpoint dir (convert_weights.py)")
  p.add_argument("--source-data", required=True, help="an ImageNet folder, 'tfds[:<name>[:<split>]]' or "
                 "'fmnist-train'")
  p.add_argument("--methods", required=True, help="comma-separated methods with source statistics")
  p.add_argument("--batch-size", type=int, default=64, help="the batch size of the runs (EATA's Fisher uses it)")
  p.add_argument("--source-images", type=int, help="use at most N images per method")
  p.add_argument("--method-args", help="JSON of per-method hyperparameters, as for the runs")
  p.add_argument("--tfds-data-dir")
  p.add_argument("--fashion-mnist-dir")
  p.add_argument("--workers", type=int)
  p.add_argument("--output", default="runs/source_stats", help="cache here if the checkpoint's folder is read-only")
  a = p.parse_args(argv)
  if a.batch_size < 1 or (a.source_images is not None and a.source_images < 1):
    raise UserError("--batch-size and --source-images must be positive")
  margs = common.parse_method_args(a.method_args)
  chosen = [methods.get(m, **margs.get(m, {})) for m in common.method_list(a.methods)]
  for m in chosen:
    if not m.uses_source_data():
      raise UserError(f"--methods: {m.name} uses no source statistics")
  model, params, meta = checkpoint.load(a.checkpoint, kind="vit")
  data = source_stats.open_source_data(a.source_data, meta, a.tfds_data_dir, a.fashion_mnist_dir)
  for m in chosen:
    source_stats.check_labels(m, data, meta["num_classes"])
  digest = checkpoint.params_digest(params)
  for m in chosen:
    source_stats.get(m, model, params, data, checkpoint_dir=a.checkpoint, output_dir=a.output,
                     batch_size=a.batch_size, limit=a.source_images, workers=a.workers, ckpt_digest=digest)
  return 0
