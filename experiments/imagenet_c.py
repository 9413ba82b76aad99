"""Main job: online test-time adaptation on ImageNet-C, printing the paper's Table 1 layout.

    python experiments/imagenet_c.py --data /data/imagenet-c --checkpoint ckpt/vit_b16 \
        --methods source,tent,sar,pcsr --corruptions all --severity 5 --seeds 2022,2023,2024 \
        --setting normal --batch-size 64 --output runs/table1

Presets (``--preset``): ``table1`` (ViT-B/16, severity 5), ``level3`` (severity 3),
``vit_large`` (ViT-L/16 with PCSR's 0.05 / 0.0001 learning rates).

Without ``--data`` it checks the foundation the harness stands on (the Flax ViT
against timm; the built-in Fashion-MNIST-C benchmark will run here instead).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from pcsr_jax.errors import run_cli  # noqa: E402

PRESETS = {
    "table1": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024)),
    "level3": dict(severity=3, setting="normal", batch_size=64, seeds=(2022, 2023, 2024)),
    "vit_large": dict(severity=5, setting="normal", batch_size=64, seeds=(2022, 2023, 2024),
                      method_args={"pcsr": {"lr_dsn": 0.05, "lr_fgn": 0.0001}}),
}


def foundation_check() -> int:
  """No --data: the Flax ViT against timm (golden fixtures; live conversion with torch + timm)."""
  import tempfile

  import jax
  import numpy as np

  jax.config.update("jax_default_matmul_precision", "highest")
  sys.path.insert(0, os.path.join(common.ROOT, "tests"))
  import golden_fixtures
  from pcsr_jax import convert
  from pcsr_jax.models import create

  print("no --data: the built-in benchmark is not in this version; checking the model against timm instead")
  for name in golden_fixtures.NAMES:
    g = golden_fixtures.load(name)
    logits = create(g["cfg"]).apply({"params": convert.timm_to_flax(g["sd"], g["cfg"])}, g["x"])
    print(f"  golden {name:28s} max |logit diff| = {float(np.abs(np.asarray(logits) - g['logits']).max()):.2e}")
  try:
    import timm  # noqa: F401
    import torch  # noqa: F401
  except ImportError:
    print("torch/timm not installed: skipping the live conversion check (pip install -e '.[convert]')")
    return 0
  from safetensors.torch import save_file

  from pcsr_jax import conversion, timm_parity
  from pcsr_jax.models import get_config

  model = timm_parity.timm_model(get_config("vit_tiny_patch16_224"))
  timm_parity.randomize_(model)
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "model.safetensors")
    save_file(model.state_dict(), src)
    r = conversion.convert_checkpoint(src, os.path.join(d, "ckpt"), verify=True)
  print(f"  random-init timm vit_tiny_patch16_224 -> convert -> Flax: max |logit diff| = {r['max_abs_diff']:.2e}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  p = common.parser("imagenet_c.py", __doc__.split("\n\n")[0], PRESETS)
  a = p.parse_args(argv)
  if a.data is None:
    return foundation_check()
  from pcsr_jax import harness

  harness.run(common.config_from_args(a, PRESETS))
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
