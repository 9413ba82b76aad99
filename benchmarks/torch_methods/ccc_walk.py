"""CCC's walk search as its official code runs it (``oripress/CCC:generate.py``, ``find_path`` and
``traverse_graph``): a memoized recursion over the accuracy matrix, dictionaries of costs and paths keyed by
cell. Plain Python and numpy (no torch is involved); it lives with the other references so that
`pcsr_jax.data.generators.ccc.find_path`, an iterative rewrite, can be checked against it.

Kept as there: the start cells (i, 0) for i >= 1, the moves (i - 1, j) and (i, j + 1), the cost past the last
column (9999999999999 on a path of length 1), the strict ``<`` in both comparisons (a tie between the moves
goes to (i, j + 1), a tie between starts to the smaller i) and the summation order (a cell's cost is its
successor's plus its own accuracy). Depth stays below rows + columns, about 42 frames on CCC's grid.
"""

from __future__ import annotations

import numpy as np

_OFF_GRID = 9999999999999
_NO_START = 99999999999  # CCC's initial "best distance"


def _visit(cost: dict, path: dict, acc: np.ndarray, i: int, j: int, target: float) -> None:
  """Fills ``cost[(i, j)]`` and ``path[(i, j)]``, visiting the two successors first."""
  if j >= acc.shape[1]:
    cost.setdefault((i, j), _OFF_GRID)
    path.setdefault((i, j), [_OFF_GRID])
    return
  if i == 0:
    cost.setdefault((i, j), acc[i][j])
    path.setdefault((i, j), [(i, j)])
    return
  for cell in ((i - 1, j), (i, j + 1)):
    if cell not in cost:
      _visit(cost, path, acc, *cell, target)
  up, right = (i - 1, j), (i, j + 1)
  d_up = abs((cost[up] + acc[i][j]) / (len(path[up]) + 1) - target)
  d_right = abs((cost[right] + acc[i][j]) / (len(path[right]) + 1) - target)
  best = up if d_up < d_right else right
  cost[(i, j)] = cost[best] + acc[i][j]
  path[(i, j)] = [(i, j)] + path[best]


def find_path(acc: np.ndarray, target: float) -> list[tuple[int, int]]:
  """The walk CCC streams for one ordered corruption pair: cells (s1 index, s2 index) from (i, 0) to row 0."""
  cost, path = {}, {}
  for i in range(1, acc.shape[0]):
    _visit(cost, path, acc, i, 0, target)
  best, chosen = _NO_START, None
  for i in range(1, acc.shape[0]):
    d = abs(cost[(i, 0)] / len(path[(i, 0)]) - target)
    if d < best:
      best, chosen = d, path[(i, 0)]
  return chosen
