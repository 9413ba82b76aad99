"""The README and docs/: the two commands CI and users run are there, and every file they point at exists."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

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
  """The README's two commands: `bash scripts/main.sh` sets everything up and runs the main job, `bash
  scripts/test.sh` sets everything up and runs the suite; `.ci/run` runs the second as the README writes it,
  and the script runs pytest over every core; the README stays a front page (at most 1,500 words)."""
  text = _read("README.md")
  indented = re.findall(r"^    (bash scripts/\S+)$", text, flags=re.M)
  assert indented[:2] == ["bash scripts/main.sh", "bash scripts/test.sh"], indented
  assert "python experiments/imagenet_c.py" in _read("scripts/main.sh")
  assert "python -m pytest -q -n auto --dist loadfile" in _read("scripts/test.sh")
  assert "$TEST_CMD" in _read(".ci/run") and "bash scripts\\/test\\.sh" in _read(".ci/run")
  words = len(re.findall(r"\S+", text))
  assert words <= 1500, f"README.md has {words} words"


def _block(text: str, first_line: str) -> str:
  """The README's fenced python block that starts with ``first_line``."""
  for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
    if block.startswith(first_line):
      return block
  raise AssertionError(f"README.md has no python block starting {first_line!r}")


@pytest.mark.slow
def test_the_readme_adapt_online_example_runs(tmp_path):
  """The README's online loop, as written, over a real stream (two Fashion-MNIST-C corruptions): it prints one
  accuracy per corruption."""
  code = _block(_read("README.md"), "# adapt online")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stdout.strip().splitlines()
  assert [l.split()[0] for l in lines[-2:]] == ["fog", "contrast"], r.stdout
  assert all(0 <= float(l.split()[1]) <= 1 for l in lines[-2:])


@pytest.mark.slow
def test_the_readme_new_method_example_runs_from_the_cli(tmp_path):
  """The README's method defined outside the package (its own file, in the folder the command runs from) runs
  from the main job with ``--methods my_methods:ConfidentTent``; results.json says where it came from."""
  (tmp_path / "my_methods.py").write_text(_block(_read("README.md"), "# my_methods.py"))
  out = tmp_path / "out"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), "--methods",
                      "source,my_methods:ConfidentTent", "--images", "64", "--corruptions", "fog", "--no-progress",
                      "--method-args", '{"confident-tent": {"lr": 0.002}}', "--output", str(out)],
                     cwd=tmp_path, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads((out / "results.json").read_text())
  assert res["config"]["methods"] == ["source", "confident-tent"]
  assert res["config"]["method_args"]["confident-tent"] == {"lr": 0.002}
  assert res["method_classes"]["confident-tent"] == "my_methods:ConfidentTent"
  assert {r["method"] for r in res["records"]} == {"source", "confident-tent"}


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


@pytest.mark.core
def test_the_parameter_paths_snippet_of_docs_methods_prints_what_the_page_shows():
  """docs/methods.md's snippet, run as written over the committed checkpoint: its output is the page's next
  block, so the module names a method's `is_trainable` sees stay the model's."""
  text = _read("docs/methods.md")
  m = re.search(r"```python\n(# parameter paths.*?)```\n\n```text\n(.*?)```", text, flags=re.S)
  assert m, "docs/methods.md has no parameter-paths snippet followed by its output"
  r = subprocess.run([sys.executable, "-c", m.group(1)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout == m.group(2)
  assert all(f"('{name}'" in m.group(2) for name in ("blocks_0", "norm", "head", "cls_token", "pos_embed"))


def test_the_readme_says_how_to_run_again_what_the_first_run_costs_and_where_the_curves_are():
  """After `bash scripts/main.sh` a user needs the venv to run again (`python3` outside it has no jax), the
  first run's one-off cost (the cache) on a named CPU, and the TensorBoard command; main.sh says it too."""
  text = _read("README.md")
  assert "`. .venv/bin/activate`" in text and "`bash scripts/main.sh ARGS`" in text
  assert re.search(r"cache\s+once \(19,200 corrupted images: \d+ s\).*2-core AMD EPYC", text, flags=re.S)
  assert re.search(r"^    tensorboard --logdir runs/builtin/tensorboard$", text, flags=re.M)
  assert ". .venv/bin/activate" in _read("scripts/main.sh") and "exec " not in _read("scripts/main.sh")
  rows = re.findall(r"^\| ([\w-]+(?: / [\w-]+)*) \| \d", text, flags=re.M)
  assert rows and not [r for r in rows if "/" in r], f"a results row of several methods: {rows}"


def test_every_docs_page_opens_with_what_it_answers_and_its_key_figures():
  """A reader sees first what a page answers and its key figures, in a table, before its detail."""
  for page in PAGES[1:]:
    head = _read(page).split("\n## ", 1)[0]
    assert "**This page answers**" in head, page
    assert "| key figure | value |\n|---|---|\n| " in head, page
