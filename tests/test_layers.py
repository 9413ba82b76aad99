"""The package's modules form layers: no import circle, and `pcsr_jax.errors`, the bottom one, imports nothing of
pcsr_jax. Read from the source (every import statement, those inside functions too), so a circle that is only
closed when a function runs is found as well."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pcsr_jax")

pytestmark = pytest.mark.core


def _modules() -> dict[str, str]:
  """Every module of the package: dotted name -> file."""
  out = {}
  for d, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """The package's modules that ``name`` imports anywhere in its file (``from pkg import sub`` names ``sub``)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([node.module] if node.module else []))
      found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
  return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_errors_is_the_bottom_layer():
  graph = _graph()
  assert "pcsr_jax.errors" in graph["pcsr_jax.malloc"]  # the reading finds imports (malloc raises UserError)
  assert graph["pcsr_jax.errors"] == set(), f"pcsr_jax.errors imports {sorted(graph['pcsr_jax.errors'])}"


def test_no_import_circle_in_the_package():
  graph = _graph()
  circles = []
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m: str) -> None:
    state[m] = 1
    path.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        circles.append(path[path.index(n):] + [n])
      elif n not in state:
        visit(n)
    path.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
