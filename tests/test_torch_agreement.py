"""JAX engine vs the PyTorch reference (benchmarks/torch_reference.py) on the same weights and batches."""

from __future__ import annotations

import numpy as np
import pytest
from flax import traverse_util

from pcsr_jax import convert, engine, methods
from pcsr_jax.models import ViTConfig, create

pytestmark = pytest.mark.torch

# 12 blocks, so that SAR's default (skip blocks 9-11) is exercised as on ViT-B.
CFG = ViTConfig(embed_dim=48, depth=12, num_heads=3, patch_size=8, img_size=32, num_classes=10)
B, STEPS = 8, 5


@pytest.fixture(scope="module")
def setup():
  from pcsr_jax import timm_parity

  model = timm_parity.timm_model(CFG)
  timm_parity.randomize_(model, seed=0, scale=0.15)
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((B, 32, 32, 3)).astype(np.float32) for _ in range(STEPS)]
  return sd, xs


def run_both(name, sd, xs, margin_factor):
  import torch

  from benchmarks.torch_reference import TorchAdapter
  from pcsr_jax import timm_parity

  ad = engine.Adapter(methods.get(name, margin_factor=margin_factor), create(CFG),
                      convert.timm_to_flax(sd, CFG), batch_size=B)
  ref = TorchAdapter(name, timm_parity.timm_model(CFG, sd), B, margin=margin_factor * np.log(CFG.num_classes),
                     pcsr_params=ad.prep.params if name == "pcsr" else None)
  state, jl, tl, reliable = ad.init_state(), [], [], []
  source = traverse_util.flatten_dict(ad.init_state().trainable)
  for x in xs:
    state, logits, metrics = ad.step(state, x)
    jl.append(np.asarray(logits))
    tl.append(ref.step(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy())
    reliable.append(int(metrics.get("num_reliable", B)))
  flat = traverse_util.flatten_dict(state.trainable)
  if name == "pcsr":
    to_torch = lambda k: f"{k[0]}.{k[1]}.{'weight' if k[2] == 'kernel' else 'bias'}"
    jax_state = {to_torch(k): np.asarray(v).T if k[2] == "kernel" else np.asarray(v) for k, v in flat.items()}
    jax_src = {to_torch(k): np.asarray(v).T if k[2] == "kernel" else np.asarray(v) for k, v in source.items()}
  else:
    full = convert.flax_to_timm(ad.params(state))
    jax_state = {k: full[k] for k in ref.adapted_state()}
    jax_src = {k: v for k, v in convert.flax_to_timm(ad.prep.params).items() if k in jax_state}
  return jl, tl, jax_state, jax_src, ref.adapted_state(), reliable


@pytest.mark.parametrize("name", ["source", "tent", "sar", "pcsr"])
def test_jax_and_pytorch_agree_on_a_short_stream(name, setup):
  sd, xs = setup
  jl, tl, js, src, ts, reliable = run_both(name, sd, xs, margin_factor=0.9)
  np.testing.assert_array_equal(jl[0].argmax(-1), tl[0].argmax(-1))  # identical first-batch predictions
  for a, b in zip(jl, tl):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  if name == "source":
    return
  assert 0 < sum(reliable) < B * STEPS or name == "tent"  # the masks really filter
  assert set(js) == set(ts)
  worst, worst_update = 0.0, 0.0
  for k in ts:
    scale = max(np.abs(ts[k]).max(), 1e-12)
    worst = max(worst, np.abs(js[k] - ts[k]).max() / scale)
    upd_t, upd_j = ts[k] - src[k], js[k] - src[k]
    worst_update = max(worst_update, np.abs(upd_j - upd_t).max() / max(np.abs(upd_t).max(), 1e-12))
  print(f"{name}: adapted params max rel diff {worst:.2e}; updates max rel diff {worst_update:.2e}")
  assert worst < 1e-4
  assert worst_update < 1e-2  # the updates themselves (not just the params) agree
  assert max(np.abs(ts[k] - src[k]).max() for k in ts) > 0  # something was adapted
