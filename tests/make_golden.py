"""Regenerates the golden fixtures in tests/golden/: the timm ones (need torch + timm), and the CIFAR-strength
corruptions of the built-in benchmark (numpy only).

    python -m tests.make_golden              # all of them
    python -m tests.make_golden corruptions  # the corruptions only

Each fixture holds a small randomized timm ViT's state dict (``sd/<timm key>``),
its config, an input batch (NHWC), timm's logits and timm's token features
after every block (``block_<i>``). `test_golden.py` checks the Flax model
against them without torch. Deterministic: torch and numpy are seeded.

``corruptions/cifar.npz`` (a folder of its own: the ``.npz`` files directly in tests/golden are the timm
fixtures `golden_fixtures` lists): every corruption at CIFAR-10-C strength, severity 3, seed 0, on the first 4
Fashion-MNIST test images (test-set indices from 500): what `test_corruptions.py` checks the built-in
benchmark's data against, within a stated tolerance on other machines.
"""

from __future__ import annotations

import json
import os

import numpy as np

from pcsr_jax.models import ViTConfig

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FIXTURES = {
    "vit_p8_d48_32px": ViTConfig(embed_dim=48, depth=2, num_heads=3, patch_size=8, img_size=32, num_classes=10),
    "vit_p16_d64_64px_mlp2": ViTConfig(embed_dim=64, depth=3, num_heads=4, patch_size=16, img_size=64,
                                       num_classes=1000, mlp_ratio=2.0),
}


def make(name: str, cfg: ViTConfig, seed: int, out_dir: str = GOLDEN_DIR) -> None:
  import torch

  from pcsr_jax import timm_parity

  torch.manual_seed(seed)
  model = timm_parity.timm_model(cfg)
  timm_parity.randomize_(model, seed=seed, scale=0.1)
  x = np.random.default_rng(seed).standard_normal((2, cfg.img_size, cfg.img_size, 3), dtype=np.float32)
  feats = []
  hooks = [b.register_forward_hook(lambda m, i, o: feats.append(o.detach().numpy())) for b in model.blocks]
  logits = timm_parity.timm_logits(model, x)
  for h in hooks:
    h.remove()
  arrays = {f"sd/{k}": v.numpy() for k, v in model.state_dict().items()}
  arrays.update({f"block_{i}": f for i, f in enumerate(feats)})
  np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), x=x, logits=logits,
                      config=np.array(json.dumps(cfg.to_dict())), **arrays)
  print(f"{name}: {sum(v.size for k, v in arrays.items() if k.startswith('sd/')):,} params, logits {logits.shape}")


CIFAR_CORRUPTIONS = os.path.join("corruptions", "cifar.npz")


def make_cifar_corruptions(out_dir: str = GOLDEN_DIR) -> None:
  from pcsr_jax.data import fashion_mnist
  from pcsr_jax.data.generators import corruptions

  x = fashion_mnist.load("test")[0][:4]
  os.makedirs(os.path.join(out_dir, os.path.dirname(CIFAR_CORRUPTIONS)), exist_ok=True)
  np.savez_compressed(os.path.join(out_dir, CIFAR_CORRUPTIONS),
                      **{c: corruptions.corrupt_batch(x, c, 3, 0, 500) for c in corruptions.ALL})
  print(f"{CIFAR_CORRUPTIONS}: {len(corruptions.ALL)} corruptions x {len(x)} images")


if __name__ == "__main__":
  import sys

  os.makedirs(GOLDEN_DIR, exist_ok=True)
  if sys.argv[1:] != ["corruptions"]:
    for i, (n, c) in enumerate(FIXTURES.items()):
      make(n, c, seed=i)
  make_cifar_corruptions()
