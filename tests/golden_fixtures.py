"""Loads the golden timm fixtures written by make_golden.py."""

from __future__ import annotations

import json
import os

import numpy as np

from pcsr_jax.models import ViTConfig

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
NAMES = sorted(f[:-4] for f in os.listdir(GOLDEN_DIR) if f.endswith(".npz"))


def load(name: str) -> dict:
  with np.load(os.path.join(GOLDEN_DIR, f"{name}.npz")) as f:
    data = {k: f[k] for k in f.files}
  cfg = ViTConfig.from_dict(json.loads(str(data.pop("config"))))
  sd = {k[3:]: data.pop(k) for k in list(data) if k.startswith("sd/")}
  depth = sum(k.startswith("block_") for k in data)
  return dict(cfg=cfg, sd=sd, x=data["x"], logits=data["logits"], blocks=[data[f"block_{i}"] for i in range(depth)])
