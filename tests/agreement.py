"""A JAX method and its PyTorch reference (``benchmarks/torch_methods/``) run side by side on one stream: the
shared loop of the newer methods' agreement tests (ZeroSiam, VCT, DCT, DPAL, REM)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import numpy as np

import float_checks
from pcsr_jax import engine, methods, timm_parity, weights
from pcsr_jax.models import ViTConfig, create

# 12 blocks, as the agreement tests of the original methods, so that blocks 0-8 against 9-11 is exercised.
CFG = ViTConfig(embed_dim=48, depth=12, num_heads=3, patch_size=8, img_size=32, num_classes=10)
B = 8


def random_model(head_scale: float = 1.0, seed: int = 0, cfg: ViTConfig = CFG) -> dict[str, np.ndarray]:
  """A randomized timm ViT's state dict (its head scaled: sharper predictions where a filter needs them)."""
  _, sd = timm_parity.random_model(cfg, seed=seed)
  sd["head.weight"] = head_scale * sd["head.weight"]
  return sd


def adapter(name: str, sd: dict, model: Any = None, cfg: ViTConfig = CFG, **hp) -> engine.Adapter:
  return engine.Adapter(methods.get(name, **hp), model if model is not None else create(cfg),
                        weights.timm_to_flax(sd, cfg), batch_size=B)


def stream(steps: int, seed: int = 1, scale: float = 1.0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [scale * rng.standard_normal((B, CFG.img_size, CFG.img_size, 3)).astype(np.float32) for _ in range(steps)]


def nchw(x: np.ndarray):
  """A batch of NHWC images (ours) as the NCHW torch tensor a reference takes."""
  import torch

  return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def step_both(ad: engine.Adapter, state: Any, ref: Any, x: np.ndarray, *ref_args: Any,
              logits_atol: float = 1e-4) -> tuple[Any, np.ndarray, dict]:
  """One step of both on ``x`` (a ragged batch too: the JAX logits of its rows only); asserts the same prediction
  for every clearly decided sample and the logits within float noise. Returns the JAX state, logits and
  metrics."""
  state, logits, metrics = ad.step(state, x)
  logits = np.asarray(logits)[:len(x)]
  t_logits = ref.step(nchw(x), *ref_args).numpy()
  float_checks.assert_predictions_match(t_logits.argmax(-1), logits)
  np.testing.assert_allclose(logits, t_logits, atol=logits_atol, rtol=1e-4)
  return state, logits, metrics


def run(ad: engine.Adapter, ref: Any, xs: Iterable[np.ndarray], logits_atol: float = 1e-4,
        before: Optional[Callable[[Any, np.ndarray], None]] = None) -> tuple[Any, list[dict]]:
  """Steps both on every batch; asserts the same prediction for every clearly decided sample and the logits
  within float noise. ``before(state, x)`` sees the JAX state before each step. Returns the JAX state and each
  step's metrics (floats)."""
  state, trace = ad.init_state(), []
  for x in xs:
    if before is not None:
      before(state, x)
    state, _, metrics = step_both(ad, state, ref, x, logits_atol=logits_atol)
    trace.append({k: float(np.asarray(v)) for k, v in metrics.items() if np.ndim(v) == 0})
  return state, trace


def compare(ad: engine.Adapter, state: Any, ref: Any,
            extra: Optional[Callable[[Any], dict[str, np.ndarray]]] = None,
            loose: tuple[str, float] = ("", 0.0)) -> tuple[float, float]:
  """The adapted tensors of both, under the reference's names (timm's for the backbone; ``extra(params)`` maps
  the method's own params), against their source values: updates within 1e-4 of their size
  (`float_checks.compare_updates`). ``loose = (prefix, rtol)``: the tensors named with that prefix, whose
  updates carry a gradient that is float rounding (DPAL's predictors), within ``rtol`` of their update's size
  instead. Returns (params max rel diff, updates max rel diff) of the others."""
  theirs = ref.adapted_state()

  def named(params):
    out = {k: v for k, v in weights.flax_to_timm(params).items() if k in theirs}
    out.update(extra(params) if extra is not None else {})
    return out

  mine, src = named(ad.params(state)), named(ad.prep.params)
  assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))
  prefix, rtol = loose
  if prefix:
    for k in [k for k in theirs if k.startswith(prefix)]:
      mine_k, theirs_k, src_k = mine.pop(k), theirs.pop(k), src.pop(k)
      size = np.abs(theirs_k - src_k).max()
      assert np.abs(mine_k - theirs_k).max() <= rtol * size + 1e-7, (k, np.abs(mine_k - theirs_k).max(), size)
  worst, worst_update, excess = float_checks.compare_updates(mine, src, theirs)
  assert worst < 1e-4 and excess <= 0, (worst, worst_update, excess)
  return worst, worst_update


def check_sar_stream(name: str, trace: list[dict], ref: Any, state: Any, threshold: Optional[float]) -> None:
  """The checks of a SAR-based method's stream (VCT, DCT, DPAL): the same filter counts, resets and EMA as the
  reference, a second filter that removes samples; with a reset ``threshold``, resets on some steps and not
  others (adaptation resumes after one) and every EMA value 3e-3 or more from it (no reset by float noise)."""
  counts = [(int(t["num_reliable"]), int(t["num_reliable2"])) for t in trace]
  resets = [int(t["reset"]) for t in trace]
  print(f"{name}: (filter 1, filter 2) per step {counts}, resets {resets}")
  assert counts == ref.counts and int(state.resets) == ref.resets == sum(resets)
  assert any(b < a for a, b in counts)  # the second filter removes samples
  np.testing.assert_allclose(trace[-1]["ema"], ref.ema, rtol=1e-5)
  if threshold is not None:
    assert 0 < sum(resets) < len(trace) - 4 and any(a and not b for a, b in zip(resets, resets[1:])), resets
    assert min(abs(t["ema"] - threshold) for t in trace) > 3e-3
