"""A command's first second: `--help`, a bad flag, a misspelled method and a preset the built-in benchmark lacks
answer before jax, flax or the methods are imported; a Python without the project's packages gets one line that
says how to set up; the light table of method names stays the registry's; the package metadata's license."""

from __future__ import annotations

import os
import subprocess
import re
import resource
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(ROOT, "experiments", "imagenet_c.py")
# Runs the main job's entry point on the given flags in this process and reports which heavy modules it imported.
PROBE = """
import sys
from pcsr_jax.experiments import imagenet_c
from pcsr_jax.errors import UserError
try:
  imagenet_c.main(sys.argv[1:])
except (SystemExit, UserError) as e:
  print("MESSAGE", e, file=sys.stderr)
print("HEAVY", sorted(m for m in ("jax", "flax", "tensorflow_datasets", "pcsr_jax.methods") if m in sys.modules))
"""


def _probe(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", PROBE, *flags], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.core
@pytest.mark.parametrize("flags, message", [
    (["--help"], None),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--methods", "source,tnet"], "--methods: unknown method 'tnet' (did you mean tent?); expected some of source,"),
    (["--methods", "eat"], "(did you mean eata or pea or eta?)"),
    (["--seeds", "1,x"], "--seeds: expected comma-separated integers, got '1,x'"),
    (["--method-args", "{"], "--method-args: not valid JSON"),
    # Empty lists once ran the built-in benchmark's default five methods; seeds past 32 bits passed to jax (a
    # repeat of a smaller seed's key, or an OverflowError). The unwritable --output stops old code at once.
    (["--methods", ",", "--output", "/dev/null/x"], "--methods: no method given (got ','); give one or more"),
    (["--methods", "", "--output", "/dev/null/x"], "--methods: no method given (got ''); give one or more"),
    (["--seeds", "18446744073709551616", "--output", "/dev/null/x"],
     "--seeds: expected integers from 0 to 4294967295, got 18446744073709551616 (jax.random.key keeps"),
    (["--seeds", "1,4294967296", "--output", "/dev/null/x"], "--seeds: expected integers from 0 to 4294967295, "
                                                             "got 4294967296"),
    (["--seeds", "-1", "--output", "/dev/null/x"], "--seeds: expected integers from 0 to 4294967295, got -1"),
    (["--preset", "continual"], "--preset continual: the continual methods' ImageNet-C protocol (the 15 corruptions "
                                "in a row, reset once); it needs --data or --clean-data with --checkpoint. Without "
                                "--data (the built-in benchmark) the one preset is table1 (every method); for this "
                                "setting on the built-in benchmark, give --setting continual instead"),
])
def test_flags_are_checked_before_jax_flax_tfds_or_the_methods_are_imported(flags, message):
  r = _probe(*flags)
  assert "HEAVY []" in r.stdout, (r.stdout[-500:], r.stderr[-2000:])
  if message is None:
    assert "usage: imagenet_c.py" in r.stdout
  else:
    assert message in r.stderr, r.stderr


@pytest.mark.core
@pytest.mark.parametrize("command", ["imagenet_c", "imagenet_rav", "wild", "ablations", "source_stats",
                                     "tune_builtin"])
@pytest.mark.parametrize("methods", [",", ""])
def test_every_command_that_takes_methods_refuses_an_empty_list_in_one_line(command, methods):
  """None of them falls back to its default methods (or runs none) on ``--methods ,`` or ``--methods ""``: one
  line, exit 2. The flags each needs otherwise are given, with an output that cannot be made, so that code that
  lets the empty list through stops at once on something else."""
  need = {"ablations": ["--table", "lr"], "source_stats": ["--checkpoint", "/nowhere", "--source-data", "/nowhere"]}
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", f"{command}.py"), "--methods", methods,
                      "--output", "/dev/null/x", *need.get(command, [])], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr == f"{command}.py: error: --methods: no method given (got {methods!r}); give one or more, " \
                     f"comma-separated\n", r.stderr[-2000:]


@pytest.mark.core
def test_the_seed_range_is_the_configs():
  """The command's early check and `RunConfig`'s take the same seeds: jax.random.key's distinct ones."""
  import jax

  from pcsr_jax import config
  from pcsr_jax.experiments import common

  assert common.MAX_SEED == config.MAX_SEED == 2**32 - 1
  keys = lambda s: tuple(int(x) for x in jax.random.key_data(jax.random.key(s)))
  assert len({keys(0), keys(common.MAX_SEED), keys(common.MAX_SEED - 1)}) == 3
  assert keys(common.MAX_SEED + 1) == keys(0)  # a seed past the range repeats one in it: why it is refused


@pytest.mark.core
def test_help_takes_under_two_cpu_seconds_through_the_command_file():
  """The command as a user types it (the allocator's restart included), in CPU seconds of the processes, which a
  loaded machine does not stretch as it does wall time. 2 s is the issue's bound on an idle 2-core machine;
  measured there: 0.35 s wall (4.7 s when the flags were parsed after importing jax, 4.9 CPU seconds)."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  r = subprocess.run([sys.executable, MAIN, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  assert r.returncode == 0 and "usage: imagenet_c.py" in r.stdout, r.stderr
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  assert cpu < 2.0, f"--help took {cpu:.2f} CPU seconds"


@pytest.mark.core
def test_a_python_without_the_packages_gets_one_line_saying_how_to_set_up():
  """``-S -I``: no site-packages, no PYTHONPATH: the project's modules are found (the command file puts its
  clone first), jax is not. One line naming the missing module and the two ways to run, exit 2."""
  r = subprocess.run([sys.executable, "-S", "-I", MAIN, "--methods", "tent"], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 2, r
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1, r.stderr
  assert lines[0].startswith("imagenet_c.py: error: the Python module '") and "is not installed for" in lines[0]
  assert "`. .venv/bin/activate`" in lines[0] and "`bash scripts/main.sh ARGS`" in lines[0]


def test_the_light_method_table_is_the_registry_and_the_presets_match_the_methods():
  from pcsr_jax import method_names, methods
  from pcsr_jax.experiments import imagenet_c

  assert method_names.NAMES == tuple(methods.REGISTRY)
  assert imagenet_c.VIT_LARGE_LRS == methods.PCSR.lrs("vit_large")
  assert imagenet_c.PRESETS["table1"]["methods"] == tuple(methods.REGISTRY)
  assert set(imagenet_c.PRESET_NEEDS) == set(imagenet_c.PRESETS) - {"table1"}


def test_the_registry_suggests_the_nearest_name():
  from pcsr_jax import methods
  from pcsr_jax.errors import UserError

  with pytest.raises(UserError, match=r"^unknown method 'tnet' \(did you mean tent\?\): expected one of source,"):
    methods.get("tnet")


@pytest.mark.parametrize("files, message", [
    ({"broken.py": "import dataclasses\ndef f(:\n  pass\n"}, r"{d}/broken\.py:2: SyntaxError: invalid syntax"),
    ({"broken.py": "x = 1\n\n\tif x:\n  pass\n"}, r"{d}/broken\.py:3: IndentationError: unexpected indent"),
    ({"broken.py": "import json\n\njson.loads('{{')\n"}, r"{d}/broken\.py:3: JSONDecodeError: Expecting property name"),
    ({"broken.py": "def f():\n  raise RuntimeError('one\\ntwo')\n\nf()\n"},
     r"{d}/broken\.py:2: RuntimeError: one / two$"),
    ({"broken.py": "import broken_helper\n", "broken_helper.py": "raise ValueError('deep')\n"},
     r"{d}/broken\.py:1: ValueError: deep$"),
])
def test_a_method_module_that_fails_to_import_is_one_line_naming_its_file_and_line(tmp_path, monkeypatch, files,
                                                                                     message):
  """``--methods module:Class`` whose module has a syntax error or raises as it runs (in its own code, or in a
  module it imports): one line naming the module, the statement of its own file that failed and the error."""
  import re

  from pcsr_jax import methods
  from pcsr_jax.errors import UserError

  for name, text in files.items():
    (tmp_path / name).write_text(text)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  for name in files:
    sys.modules.pop(name[:-3], None)
  with pytest.raises(UserError) as e:
    methods.load("broken:Mine")
  assert "\n" not in str(e.value)
  assert str(e.value).startswith("--methods broken:Mine: cannot import broken: "), str(e.value)
  assert re.search(message.format(d=re.escape(str(tmp_path))), str(e.value)), str(e.value)


def test_a_method_module_that_raises_ends_the_command_in_one_line(tmp_path):
  """The command as typed: one line on stderr, exit 2, no traceback."""
  (tmp_path / "broken.py").write_text("x = 1\nraise KeyError('nope')\n")
  r = subprocess.run([sys.executable, MAIN, "--methods", "source,broken:Mine", "--output", str(tmp_path / "o")],
                     cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and r.stderr == (f"imagenet_c.py: error: --methods broken:Mine: cannot import broken: "
                                            f"{tmp_path}/broken.py:2: KeyError: 'nope'\n"), r.stderr[-3000:]


@pytest.mark.core
def test_license_is_an_spdx_string_and_setuptools_reads_it():
  """PEP 639's ``license = "Apache-2.0"`` (a TOML table makes setuptools print a deprecation box at every
  install); setuptools reads it from version 77 on."""
  with open(os.path.join(ROOT, "pyproject.toml")) as f:
    text = f.read()
  assert re.search(r'^license = "Apache-2.0"$', text, flags=re.M), "project.license is not an SPDX string"
  assert re.search(r'^requires = \["setuptools>=77"\]', text, flags=re.M)
