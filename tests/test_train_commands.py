"""Bad input to the training commands `train_prompts` (DePT-G's source stage) and `train_source` (the built-in
source ViT), and what the three commands (with `train_ddpm`, tested in `tests/test_train_ddpm.py`) share from
`pcsr_jax.experiments.train_checks` and `pcsr_jax.files.check_output_dir`: one line and exit 2 before any
training work for a bad flag or ``--out``; a diverging run stopped at its first non-finite loss with nothing
written as finished; a source whose images are partly unreadable trained on the rest (and counted), one whose
images are all unreadable refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import files
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import train_checks, train_prompts, train_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train_source at its smallest: one epoch of 4 steps of 64 images, a one-block ViT.
SOURCE = ["--epochs", "1", "--train-limit", "256", "--batch-size", "64", "--embed-dim", "32", "--depth", "1",
          "--num-heads", "2", "--eval-every", "1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """A 16-image source folder (4 classes x 4 JPEGs) and the tiny 1000-class checkpoint."""
  root = tmp_path_factory.mktemp("train_world")
  hf.make_imagenet_c(str(root / "data"), corruptions=("fog",), classes=4, per_class=4)
  hf.make_checkpoint(str(root / "ckpt"))
  return root


def _prompts(world, out, *extra, source=None):
  """`train_prompts.main` at its smallest: one epoch of 4 steps of 4 images, 2 stages of 2 prompts."""
  argv = ["--checkpoint", str(world / "ckpt"), "--source-data", str(source or world / "data" / "fog" / "5"),
          "--out", str(out), "--batch-size", "4", "--epochs", "1", "--stages", "2", "--prompts", "2",
          "--dino-hidden", "16", "--dino-bottleneck", "8", "--dino-out", "12", "--warmup-steps", "2",
          "--checkpoint-every", "2", "--no-progress", *extra]
  return train_prompts.main(argv)


def _source(out, *extra):
  return train_source.main(["--out", str(out), *SOURCE, *extra])


def _unreadable_copy(world, tmp_path, keep: int):
  """A copy of the source folder with all but its first ``keep`` JPEGs replaced by bytes no decoder reads;
  returns the folder and the names (``<wnid>/<file>``) made unreadable."""
  folder = tmp_path / "source"
  shutil.copytree(str(world / "data" / "fog" / "5"), str(folder))
  broken = []
  for i, p in enumerate(sorted(glob.glob(str(folder / "*" / "*.JPEG")))):
    if i >= keep:
      with open(p, "wb") as f:
        f.write(b"not a jpeg")
      broken.append(os.path.relpath(p, str(folder)))
  return folder, broken


# ---------------------------------------------------------------- the shared checks

def test_check_output_dir_refuses_a_file_in_the_way_and_creates_nothing(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(UserError, match=rf"^--out {re.escape(str(f))}: exists and is not a directory$"):
    files.check_output_dir(str(f), "--out")
  deep = f / "a" / "b"
  with pytest.raises(UserError, match=rf"^--out {re.escape(str(deep))}: {re.escape(str(f))} exists and is not a "
                                      rf"directory$"):
    files.check_output_dir(str(deep), "--out")
  with pytest.raises(UserError, match=r"^--out: empty path$"):
    files.check_output_dir("", "--out")
  files.check_output_dir(str(tmp_path / "new" / "deeper"), "--out", beside=True)
  assert not (tmp_path / "new").exists() and f.read_text() == "x"


def test_check_flags_bounds_the_seed_and_names_the_flag():
  """A seed past 32 bits would start from another seed's init (`jax.random.key` keeps the low 32 bits)."""
  import argparse

  ok = argparse.Namespace(seed=train_checks.SEED_MAX, steps=1, warmup=0, lr=1e-3, wd=0.0, none=None)
  train_checks.check_flags(ok, positive=("steps", "none"), non_negative=("warmup",), positive_floats=("lr",),
                           non_negative_floats=("wd",))
  for seed in (-1, train_checks.SEED_MAX + 1):
    with pytest.raises(UserError, match=rf"^--seed: expected an integer in \[0, 4294967295\], got {seed}$"):
      train_checks.check_flags(argparse.Namespace(seed=seed))
  cases = (("steps", 0, "positive", "--steps: expected a positive integer, got 0"),
           ("warmup", -1, "non_negative", "--warmup: expected an integer >= 0, got -1"),
           ("lr", float("inf"), "positive_floats", "--lr: expected a number > 0, got inf"),
           ("wd", float("nan"), "non_negative_floats", "--wd: expected a number >= 0, got nan"))
  for field, value, kind, match in cases:
    with pytest.raises(UserError, match=f"^{match}$"):
      train_checks.check_flags(argparse.Namespace(seed=0, **{field: value}), **{kind: (field,)})


def test_check_finite_names_the_step_and_the_lr():
  train_checks.check_finite(3, 0.1, loss=1.0, params={"w": np.ones(2)})
  with pytest.raises(UserError, match=r"^training diverged at step 3: non-finite loss \(nan\); "
                                      r".*lower --lr than 0\.1$"):
    train_checks.check_finite(3, 0.1, loss=float("nan"))
  with pytest.raises(UserError, match=r"^training diverged at step 4: non-finite parameters; "):
    train_checks.check_finite(4, 0.1, params={"a": np.ones(2), "b": np.array([1.0, np.inf])})


@pytest.mark.parametrize("script", ["train_prompts.py", "train_source.py", "train_ddpm.py"])
def test_a_negative_seed_is_one_line_and_exit_2(script, tmp_path):
  """Through the command itself (`run_cli`): the line, nothing else on stderr, exit code 2."""
  argv = ["--seed", "-1", "--out", str(tmp_path / "o")]
  if script == "train_prompts.py":
    argv += ["--checkpoint", str(tmp_path / "ckpt"), "--source-data", str(tmp_path / "src")]
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *argv], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip() == f"{script}: error: --seed: expected an integer in [0, 4294967295], got -1"
  assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- train_prompts

def test_prompts_out_that_is_a_file_or_under_one_is_refused_before_training(world, tmp_path, capsys):
  f = tmp_path / "file"
  f.write_text("x")
  for out, match in ((f, "exists and is not a directory"), (f / "sub", f"{f} exists and is not a directory")):
    with pytest.raises(UserError, match=f"^--out {re.escape(str(out))}: {re.escape(match)}$"):
      _prompts(world, out)
  assert capsys.readouterr().out == "" and f.read_text() == "x"


@pytest.mark.parametrize("flag, value, match", [
    ("--seed", "-1", r"--seed: expected an integer in \[0, 4294967295\], got -1"),
    ("--lr", "nan", r"--lr: expected a number > 0, got nan"),
    ("--warmup-steps", "-1", r"--warmup-steps: expected an integer >= 0, got -1"),
    ("--images", "0", r"--images: expected a positive integer, got 0"),
    ("--batch-size", "32", r"--batch-size 32: more than the 16 source images"),
])
def test_prompts_bad_flags_are_one_line_errors_before_training(world, tmp_path, capsys, flag, value, match):
  with pytest.raises(UserError, match=f"^{match}$"):
    _prompts(world, tmp_path / "o", flag, value)
  assert "dept-g source stage" not in capsys.readouterr().out and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_prompts_a_diverging_run_stops_with_nothing_finished(world, tmp_path):
  """--lr 1e30: step 1 of the 2-step warm-up has lr 0, step 2's update moves the prompts and head by ~1e30,
  and step 3's loss is NaN; the run stops there, writing no params.npz or record.json."""
  with pytest.raises(UserError, match=r"^training diverged at step 3: non-finite loss \(nan\); nothing was written "
                                      r"as finished; try a lower --lr than 1e\+30$"):
    _prompts(world, tmp_path / "o", "--lr", "1e30")
  assert not (tmp_path / "o" / "record.json").exists() and not (tmp_path / "o" / "params.npz").exists()


@pytest.mark.slow
def test_prompts_skip_and_count_unreadable_source_images(world, tmp_path, capsys):
  """14 of the 16 images unreadable: at least two of the 4 batches hold none that can be read (the loader's
  empty batch is where `transforms.normalize` used to fail). The run trains on the 2 readable images, logs
  the count and names the 14 in its record, with finite params."""
  source, broken = _unreadable_copy(world, tmp_path, keep=2)
  assert _prompts(world, tmp_path / "o", source=source) == 0
  rec = json.loads((tmp_path / "o" / "record.json").read_text())
  assert rec["unreadable_images"] == 14 and rec["unreadable"] == sorted(broken) and rec["steps"] == 4
  assert "skipped 14 unreadable source images of 16" in capsys.readouterr().out
  with np.load(str(tmp_path / "o" / "params.npz")) as z:
    assert all(np.isfinite(z[k]).all() for k in z.files)


def test_prompts_refuse_a_source_with_no_readable_image(world, tmp_path, capsys):
  source, _ = _unreadable_copy(world, tmp_path, keep=0)
  with pytest.raises(UserError, match=rf"^--source-data {re.escape(str(source))}: none of the 16 source images "
                                      rf"could be read \(e\.g\. "):
    _prompts(world, tmp_path / "o", source=source)
  assert "dept-g source stage" not in capsys.readouterr().out and not (tmp_path / "o").exists()


# ---------------------------------------------------------------- train_source

def test_source_out_that_is_a_file_or_under_one_is_refused_before_training(tmp_path, capsys):
  f = tmp_path / "file"
  f.write_text("x")
  for out, extra, match in ((f, ("--force",), "exists and is not a directory"),
                            (f / "sub", (), f"{f} exists and is not a directory")):
    with pytest.raises(UserError, match=f"^--out {re.escape(str(out))}: {re.escape(match)}$"):
      _source(out, *extra)
  assert capsys.readouterr().out == "" and f.read_text() == "x"


@pytest.mark.parametrize("flag, value, match", [
    ("--seed", "-1", r"--seed: expected an integer in \[0, 4294967295\], got -1"),
    ("--patch-size", "0", r"--patch-size: expected a positive integer, got 0"),
    ("--num-heads", "0", r"--num-heads: expected a positive integer, got 0"),
    ("--train-limit", "0", r"--train-limit: expected a positive integer, got 0"),
    ("--lr", "inf", r"--lr: expected a number > 0, got inf"),
    ("--weight-decay", "-0.1", r"--weight-decay: expected a number >= 0, got -0.1"),
    ("--batch-size", "300", r"--batch-size 300: more than the 256 training images"),
])
def test_source_bad_flags_are_one_line_errors_before_training(tmp_path, capsys, flag, value, match):
  with pytest.raises(UserError, match=f"^{match}$"):
    _source(tmp_path / "o", flag, value)
  assert "params," not in capsys.readouterr().out and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_source_a_diverging_run_stops_with_nothing_written(tmp_path):
  """--lr 1e30: the warm-up's step 1 has lr 0, step 2's AdamW update moves every weight by ~1e30, and step 3's
  loss is NaN; the run stops there, before the checkpoint is written."""
  with pytest.raises(UserError, match=r"^training diverged at step 3: non-finite loss \(nan\); nothing was written "
                                      r"as finished; try a lower --lr than 1e\+30$"):
    _source(tmp_path / "o", "--lr", "1e30")
  assert not (tmp_path / "o").exists()
