"""Comparisons of predictions computed by two different XLA programs (batch shapes, fusions, thread counts).

Two programs that compute the same logits agree only to float rounding, so an argmax may flip where the top
two logits are within rounding of each other. These helpers compare predictions exactly wherever the decision
is clear, and bound everything else by the number of near-ties, on any x86-64 CPU and thread count.
"""

from __future__ import annotations

import numpy as np

# float32 logits of the test models are O(1-10); two XLA programs differ by ~1e-6 there. 1e-4 is 100x that.
TIE_GAP = 1e-4


def near_ties(logits: np.ndarray, gap: float = TIE_GAP) -> np.ndarray:
  """Rows whose two largest logits are within ``gap``: their argmax is not decided above float noise."""
  top2 = np.sort(np.asarray(logits, np.float64), axis=-1)[:, -2:]
  return (top2[:, 1] - top2[:, 0]) <= gap


def _few_ties(logits: np.ndarray) -> np.ndarray:
  """The near-tie rows, asserted to be few enough for a comparison to say something."""
  ties = near_ties(logits)
  assert ties.mean() < 0.1, f"{ties.sum()} of {len(ties)} rows are near-ties: the comparison would say little"
  return ties


def assert_predictions_match(predictions: np.ndarray, logits: np.ndarray) -> None:
  """``predictions`` (from one program) equal ``argmax(logits)`` (from another) on every clearly decided row."""
  ties = _few_ties(logits)
  np.testing.assert_array_equal(np.asarray(predictions)[~ties], np.asarray(logits).argmax(-1)[~ties])


def assert_accuracy_matches(accuracy: float, logits: np.ndarray, labels: np.ndarray) -> None:
  """A count-based accuracy equals the direct one, up to one image per near-tie (none when there is none)."""
  ties = _few_ties(logits)
  direct = int((np.asarray(logits).argmax(-1) == labels).sum())
  assert abs(round(accuracy * len(labels)) - direct) <= int(ties.sum()), (accuracy * len(labels), direct, ties.sum())


def compare_updates(js: dict, src: dict, ts: dict) -> tuple[float, float, float]:
  """Max relative differences of the adapted params and of the updates ``params - source``, and the largest
  excess of an update difference over its bound ``1e-4 * |update| + 1e-6 * |param|`` (<= 0: all within)."""
  assert set(js) == set(ts) and len(js) > 0
  worst, worst_update, biggest, excess = 0.0, 0.0, 0.0, -np.inf
  for k in ts:
    upd_t, upd_j = ts[k] - src[k], js[k] - src[k]
    diff, size = np.abs(upd_j - upd_t).max(), np.abs(upd_t).max()
    biggest = max(biggest, size)
    worst = max(worst, np.abs(js[k] - ts[k]).max() / max(np.abs(ts[k]).max(), 1e-12))
    worst_update = max(worst_update, diff / max(size, 1e-12))
    excess = max(excess, diff - (1e-4 * size + 1e-6 * np.abs(ts[k]).max()))
  assert biggest > 0  # something was adapted
  return worst, worst_update, excess
