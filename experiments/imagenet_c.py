"""Main job: online test-time adaptation on ImageNet-C (and the built-in benchmark).

The harness (data streams, methods, tables) lands with the engine and harness
issues. Until then this entry point checks the foundation everything stands on:
the Flax ViT against timm, on the committed golden fixtures (no torch needed) and,
where torch and timm are installed, on a freshly randomized timm model converted
through ``convert_weights.py``'s pipeline.

    python experiments/imagenet_c.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from pcsr_jax.errors import ArgumentParser, run_cli  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="imagenet_c.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--arch", default="vit_tiny_patch16_224", help="arch of the random-init timm model to convert")
  a = p.parse_args(argv)

  import jax
  import numpy as np

  jax.config.update("jax_default_matmul_precision", "highest")
  import golden_fixtures
  from pcsr_jax import convert
  from pcsr_jax.models import create

  print("Flax ViT vs timm (golden fixtures, float32):")
  for name in golden_fixtures.NAMES:
    g = golden_fixtures.load(name)
    logits = create(g["cfg"]).apply({"params": convert.timm_to_flax(g["sd"], g["cfg"])}, g["x"])
    print(f"  {name:28s} max |logit diff| = {float(np.abs(np.asarray(logits) - g['logits']).max()):.2e}")
  try:
    import timm  # noqa: F401
    import torch  # noqa: F401
  except ImportError:
    print("torch/timm not installed: skipping the live conversion check (pip install -e '.[convert]')")
    return 0
  from safetensors.torch import save_file

  from pcsr_jax import conversion, timm_parity
  from pcsr_jax.models import get_config

  model = timm_parity.timm_model(get_config(a.arch))
  timm_parity.randomize_(model)
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "model.safetensors")
    save_file(model.state_dict(), src)
    r = conversion.convert_checkpoint(src, os.path.join(d, "ckpt"), verify=True)
  print(f"random-init timm {a.arch} -> convert -> Flax: max |logit diff| = {r['max_abs_diff']:.2e} "
        f"(max |logit| {r['max_abs_logit']:.2f})")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
