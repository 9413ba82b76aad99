"""The README and docs/: the two commands CI and users run are there, and every file they point at exists."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# A markdown link or image whose target is a path in this repo (not a URL, not an anchor).
LINK = re.compile(r"\]\(([^)#\s]+)\)")
# A backticked repo path: `docs/x.md`, `experiments/results/cpu/step_throughput.md`, `benchmarks/gpu.sh`.
PATH = re.compile(r"`((?:docs|experiments|benchmarks|pcsr_jax|tests|assets)/[\w./-]+?\.(?:md|py|sh|png|json))`")


def _read(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def test_readme_holds_the_two_commands_ci_runs():
  """`.ci/run` takes the first indented `python -m pytest` line of the README as its test command; the main
  job's command is the other one the README promises."""
  text = _read("README.md")
  indented = re.findall(r"^    (python .*)$", text, flags=re.M)
  assert [c for c in indented if c.startswith("python -m pytest")][0] == "python -m pytest -q -n auto --dist loadfile"
  assert "python experiments/imagenet_c.py" in indented
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    assert "python -m pytest" in f.read()


def test_every_link_and_repo_path_in_the_readme_and_docs_exists():
  assert len(PAGES) >= 5, PAGES  # README + the four docs pages
  missing = []
  for page in PAGES:
    base = os.path.dirname(os.path.join(ROOT, page))
    text = _read(page)
    for target in LINK.findall(text):
      if not re.match(r"[a-z]+:", target) and not os.path.exists(os.path.join(base, target)):
        missing.append(f"{page}: link {target}")
    for path in PATH.findall(text):
      if "{" not in path and "*" not in path and not os.path.exists(os.path.join(ROOT, path)):
        missing.append(f"{page}: path {path}")
  assert not missing, missing
  readme = _read("README.md")
  for page in PAGES[1:]:
    assert f"]({page})" in readme, f"README.md does not link {page}"


# Where a user copies a command from: the pages, the results' records, the GPU script, the scripts' docstrings.
COMMAND_FILES = PAGES + sorted(
    os.path.relpath(p, ROOT) for pattern in ("experiments/results/**/*.md", "benchmarks/**/*.py", "benchmarks/*.sh",
                                             "experiments/*.py", "tests/*.py", "convert_weights.py")
    for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))
# `python benchmarks/x.py` (possibly wrapped after `python`): the scripts are modules of the `benchmarks` package.
SCRIPT_FORM = re.compile(r"\bpython3?\s+(?:#\s*)?benchmarks/\w+\.py")
MODULE_FORM = re.compile(r"\bpython3?\s+-m\s+(?:#\s*)?((?:benchmarks|tests)\.\w+)")


def test_benchmark_commands_run_them_as_modules():
  assert "README.md" in COMMAND_FILES and "benchmarks/gpu.sh" in COMMAND_FILES, COMMAND_FILES
  old, missing, seen = [], [], set()
  for page in COMMAND_FILES:
    if page == "tests/test_docs.py":
      continue
    text = _read(page)
    old += [f"{page}: {m.group(0)!r}" for m in SCRIPT_FORM.finditer(text)]
    for module in MODULE_FORM.findall(text):
      seen.add(module)
      if not os.path.isfile(os.path.join(ROOT, *module.split(".")) + ".py"):
        missing.append(f"{page}: python -m {module}")
  assert not old, f"run as `python -m benchmarks.<name>` from the repository root: {old}"
  assert not missing, missing
  assert "benchmarks.step_throughput" in seen and "benchmarks.gpu_report" in seen, seen
