"""Hostile input and broken state: every class of fault ends in a one-line error (exit 2) or a correct run.

One test per class: damaged checkpoints, flag values, output paths, diverging streams, nothing evaluated,
resume over changed data or damaged state, unreadable folders and FIFOs, and convert_weights.py's inputs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import checkpoint, harness, progress
from pcsr_jax.errors import UserError
from pcsr_jax.experiments.imagenet_c import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORR = ("gaussian_noise", "fog")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return hf.make_world(tmp_path_factory.mktemp("hostile"), CORR, classes=2, per_class=4)


def run(world, out, *flags, data=None, ckpt=None):
  return main(["--data", str(data or world / "data"), "--checkpoint", str(ckpt or world / "ckpt"), "--output",
               str(out), "--seeds", "1", "--batch-size", "4", "--no-progress", "--corruptions", ",".join(CORR),
               *flags])


def fails(match, world, out, *flags, **kw):
  with pytest.raises(UserError, match=match) as e:
    run(world, out, *flags, **kw)
  assert "\n" not in str(e.value)
  assert not os.path.exists(os.path.join(str(out), "results.json"))  # nothing claims completion


def edit_meta(ckpt_dir, **changes):
  path = os.path.join(ckpt_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  for k, v in changes.items():
    if k.startswith("model."):
      meta["model"][k[6:]] = v
    else:
      meta[k] = v
  with open(path, "w") as f:
    json.dump(meta, f)


def copy_ckpt(world, tmp_path, name):
  dst = str(tmp_path / name)
  shutil.copytree(str(world / "ckpt"), dst)
  return dst


def test_damaged_checkpoints(world, tmp_path):
  c = copy_ckpt(world, tmp_path, "depth")
  edit_meta(c, **{"model.depth": 1})  # params hold 2 blocks: the second would be ignored silently
  fails("params do not match the metadata's model", world, tmp_path / "o1", ckpt=c)
  c = copy_ckpt(world, tmp_path, "size")
  edit_meta(c, img_size=64)
  fails("img_size 64 but its model config 32", world, tmp_path / "o2", ckpt=c)
  c = copy_ckpt(world, tmp_path, "arch")
  edit_meta(c, arch="vit_base_patch16_224")
  fails("arch vit_base_patch16_224 but its model config", world, tmp_path / "o2b", ckpt=c)
  c = copy_ckpt(world, tmp_path, "std")
  edit_meta(c, std=[0.5, 0.0, 0.5])
  fails("'std' must be positive", world, tmp_path / "o3", ckpt=c)
  c = copy_ckpt(world, tmp_path, "notjson")
  with open(os.path.join(c, "meta", "metadata"), "w") as f:
    f.write("{not json")
  fails("checkpoint metadata unreadable", world, tmp_path / "o4", ckpt=c)
  c = copy_ckpt(world, tmp_path, "trunc")
  for p in glob.glob(os.path.join(c, "params", "**", "d", "*"), recursive=True):
    with open(p, "r+b") as f:
      f.truncate(10)
  fails("checkpoint params unreadable", world, tmp_path / "o5", ckpt=c)
  c = copy_ckpt(world, tmp_path, "nodata")
  shutil.rmtree(os.path.join(c, "params", "d"))
  fails("checkpoint params unreadable", world, tmp_path / "o6", ckpt=c)
  # Through the real CLI: one line on stderr, although orbax's failed async read leaves callbacks behind.
  c = copy_ckpt(world, tmp_path, "manifest")
  with open(os.path.join(c, "params", "manifest.ocdbt"), "w") as f:
    f.write("garbage")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), "--data",
                      str(world / "data"), "--checkpoint", c, "--output", str(tmp_path / "o_cli"), "--corruptions",
                      "fog"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and "checkpoint params unreadable" in r.stderr, r.stderr[-2000:]
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
  # NaN weights: saved through the real writer.
  model, params, meta = checkpoint.load(str(world / "ckpt"))
  params["blocks_0"]["attn"]["qkv"]["kernel"][0, 0] = np.nan
  c = checkpoint.save(str(tmp_path / "nan"), params, meta)
  fails(r"1 param arrays hold NaN or inf \(e.g. blocks_0/attn/qkv/kernel\)", world, tmp_path / "o7", ckpt=c)


def test_flag_values(world, tmp_path):
  for match, flags in (("--corruptions: no corruption given", ["--corruptions", ","]),
                       ("--methods: no method given", ["--methods", ","]),
                       ("--seeds: expected integers from 0 to 4294967295, got -1", ["--seeds", "-1"]),
                       ("--workers: expected a positive integer", ["--workers", "-2"]),
                       ("--row-chunk: expected a positive integer", ["--row-chunk", "0"]),
                       ("--imbalance-ratio: expected a number >= 1", ["--imbalance-ratio", "-1"]),
                       ("tent lr: expected None or float, got 'fast'", ["--method-args", '{"tent": {"lr": "fast"}}']),
                       ("tent lr: expected None or a number > 0, got nan", ["--method-args", '{"tent": {"lr": NaN}}']),
                       ("--eval-order perturbed: not available for source", ["--eval-order", "perturbed"]),
                       ("--source-images: expected a positive integer", ["--source-images", "0"]),
                       ("--source-data /nowhere: not a folder", ["--source-data", "/nowhere"]),
                       ("--source-data tfds:x:y:z: expected tfds", ["--source-data", "tfds:x:y:z"]),
                       ("--cpu-devices: expected a positive number of devices, got 0", ["--cpu-devices", "0"])):
    fails(match, world, tmp_path / "out", *flags)
  jax.devices()  # the backend runs in this process: too late to split the CPU
  fails("--cpu-devices: too late", world, tmp_path / "out", "--cpu-devices", "2")
  from pcsr_jax import engine

  engine.use_cpu_devices(len(jax.local_devices(backend="cpu")))  # as many as it runs: nothing to change, no error


def test_output_paths(world, tmp_path):
  (tmp_path / "afile").write_text("x")
  fails("exists and is not a directory", world, tmp_path / "afile")
  fails("not writable", world, tmp_path / "afile" / "under")
  fails("--output: empty path", world, "")


@pytest.mark.parametrize("name, resume", [("log.txt", False), ("table.md", False), ("results.csv", True),
                                          ("tensorboard", False), ("tensorboard/units", True), ("resume", True),
                                          ("resume/units", True), ("predictions", False)])
def test_a_link_where_the_run_writes_is_refused_and_nothing_is_written_through_it(world, tmp_path, name, resume):
  """A symbolic link in --output where the run writes (a file of its outputs, one of its folders, or a folder
  inside them): one line naming it, before any work, and nothing written where it points (a link to a folder
  was entered by ``makedirs``; ``rmtree`` refuses to remove one, so a fresh run did not clear it)."""
  out = tmp_path / "o"
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("the user's file")
  path = out / name
  path.parent.mkdir(parents=True, exist_ok=True)
  target = outside if name in ("tensorboard", "tensorboard/units", "resume", "resume/units", "predictions") \
      else outside / "keep.txt"
  os.symlink(target, path)
  fails(f"^--output {out}: {path} is a symbolic link \\(to {target}\\); the run writes there and follows no link",
        world, out, *(["--resume"] if resume else []), "--save-predictions")
  assert sorted(os.listdir(outside)) == ["keep.txt"] and (outside / "keep.txt").read_text() == "the user's file"


def test_divergence_stops_the_run(world, tmp_path):
  # A learning rate this large drives TENT's LayerNorms to inf/NaN within a few steps.
  fails(r"tent/seed1 diverged on \w+ at batch \d+: non-finite logits", world, tmp_path / "o", "--methods", "tent",
        "--method-args", '{"tent": {"lr": 1e30}}', "--corruptions", "fog")


def test_nothing_evaluated_is_an_error(world, tmp_path):
  data = tmp_path / "data"
  shutil.copytree(str(world / "data"), str(data))
  for p in glob.glob(str(data / "fog" / "5" / "*" / "*.JPEG")):
    with open(p, "wb") as f:
      f.write(b"not a jpeg")
  fails(r"no image of fog was evaluated for source seed 1 \(8 unreadable", world, tmp_path / "o", "--methods",
        "source", data=data)


def test_skipped_images_are_counted_once(world, tmp_path, capsys):
  data = tmp_path / "data"
  shutil.copytree(str(world / "data"), str(data))
  bad = sorted(glob.glob(str(data / "fog" / "5" / "*" / "*.JPEG")))[0]
  with open(bad, "wb") as f:
    f.write(b"broken")
  res = harness.run(harness.RunConfig(data=str(data), checkpoint=str(world / "ckpt"), output=str(tmp_path / "o"),
                                      corruptions=CORR, methods=("source", "tent"), seeds=(1, 2), batch_size=4,
                                      progress=False), log=print)
  assert len(res["skipped"]) == 1
  assert "skipped 1 unreadable images" in capsys.readouterr().out
  assert {r["num_skipped"] for r in res["records"] if r["corruption"] == "fog"} == {1}


def test_resume_refuses_changed_data_and_damaged_state(world, tmp_path):
  data = tmp_path / "data"
  shutil.copytree(str(world / "data"), str(data))
  out = tmp_path / "o"
  cfg = dict(data=str(data), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR, methods=("tent",),
             seeds=(1,), batch_size=4, progress=False, checkpoint_every=1)
  # Stop after the first saved batch, as SIGTERM would, and keep the saved progress.
  calls = []

  def stop_after_one(*a):  # the signal lands after the first save: the next batch (its unit's last) is saved open
    calls.append(1)
    if len(calls) == 1:
      os.kill(os.getpid(), signal.SIGTERM)
  orig = progress.Resume.save_unit
  progress.Resume.save_unit = lambda self, rec, host_state=None: (orig(self, rec, host_state), stop_after_one())
  try:
    with pytest.raises(SystemExit):
      harness.run(harness.RunConfig(**cfg), log=lambda *a: None)
  finally:
    progress.Resume.save_unit = orig
  progress_json = out / "resume" / "progress.json"
  assert progress_json.exists()
  saved = progress_json.read_text()
  # The data changed while interrupted: one image removed, another added.
  victim = sorted(glob.glob(str(data / "fog" / "5" / "*" / "*.JPEG")))[-1]
  moved = victim + ".bak"
  os.rename(victim, moved)
  with pytest.raises(UserError, match="the data changed since the progress was saved"):
    harness.run(harness.RunConfig(**cfg, resume=True), log=lambda *a: None)
  os.rename(moved, victim)
  # Garbage or wrongly typed progress: the run's manifest, or the open unit's record.
  for text in ("{garbage", json.dumps([1, 2]), json.dumps({**json.loads(saved), "units": 5})):
    progress_json.write_text(text)
    with pytest.raises(UserError, match="saved progress is damaged.*rerun without --resume"):
      harness.run(harness.RunConfig(**cfg, resume=True), log=lambda *a: None)
  progress_json.write_text(saved)
  (unit_json,) = glob.glob(str(out / "resume" / "units" / "*" / "unit.json"))
  unit_saved = open(unit_json).read()
  for text in ("{garbage", json.dumps({**json.loads(unit_saved), "records": 5})):
    with open(unit_json, "w") as f:
      f.write(text)
    with pytest.raises(UserError, match=r"unit.json: saved progress is damaged.*rerun without --resume"):
      harness.run(harness.RunConfig(**cfg, resume=True), log=lambda *a: None)
  with open(unit_json, "w") as f:
    f.write(unit_saved)
  # A deleted state directory.
  for d in glob.glob(str(out / "resume" / "units" / "*" / "state_*")):
    shutil.rmtree(d)
  with pytest.raises(UserError, match="saved adaptation state is damaged or missing"):
    harness.run(harness.RunConfig(**cfg, resume=True), log=lambda *a: None)
  # Without --resume the saved progress is discarded, and the run says so.
  lines = []
  harness.run(harness.RunConfig(**cfg), log=lines.append)
  assert any(l.startswith("discarding the saved progress") for l in lines)


def test_unreadable_class_folder_and_fifo(world, tmp_path):
  data = tmp_path / "data"
  shutil.copytree(str(world / "data"), str(data))
  wnid_dir = sorted((data / "fog" / "5").iterdir())[0]
  fifo = wnid_dir / "ILSVRC2012_val_99999999.JPEG"
  os.mkfifo(str(fifo))
  t0 = time.time()
  res = harness.run(harness.RunConfig(data=str(data), checkpoint=str(world / "ckpt"), output=str(tmp_path / "o"),
                                      corruptions=("fog",), methods=("source",), seeds=(1,), batch_size=4,
                                      progress=False), log=lambda *a: None)
  assert time.time() - t0 < 120 and res["skipped"] == [f"fog/{wnid_dir.name}/{fifo.name}"]  # skipped, no hang
  os.remove(str(fifo))
  if os.geteuid() != 0:  # root reads any folder: the permission case only exists for other users
    os.chmod(str(wnid_dir), 0)
    try:
      fails("cannot list the folder", world, tmp_path / "o2", "--corruptions", "fog", data=data)
    finally:
      os.chmod(str(wnid_dir), stat.S_IRWXU)
  else:
    from pcsr_jax.data import sources

    with pytest.raises(UserError, match="cannot list the folder"):  # the same guard, on a path that is a file
      sources.listdir(str(fifo.parent / "ILSVRC2012_val_00000000.JPEG"))


@pytest.mark.torch
def test_convert_weights_bad_tensors(tmp_path):
  from safetensors.numpy import save_file

  from pcsr_jax.models import configs
  from pcsr_jax.weights import flax_to_timm
  from pcsr_jax.models import create, init_params
  import jax

  cfg = configs.get_config("vit_tiny_patch16_224", 10)
  sd = {k: np.asarray(v) for k, v in flax_to_timm(jax.tree.map(np.asarray, init_params(create(cfg),
                                                                                      jax.random.key(0)))).items()}

  def convert(name, tensors, *flags, out=None):
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    return subprocess.run([sys.executable, os.path.join(ROOT, "convert_weights.py"),
                           str(tmp_path / f"{name}.safetensors"), "--out", str(out or tmp_path / f"out_{name}"),
                           *flags], capture_output=True, text=True, timeout=300)

  rank1 = dict(sd, **{"patch_embed.proj.weight": sd["patch_embed.proj.weight"].reshape(-1)})
  nan = dict(sd, **{"head.bias": np.full_like(sd["head.bias"], np.nan)})
  (tmp_path / "afile").write_text("x")
  for name, tensors, flags, out, msg in (
      ("rank1", rank1, [], None, "'patch_embed.proj.weight' has shape"),
      ("nan", nan, [], None, "1 tensors hold NaN or inf (e.g. 'head.bias')"),
      ("std0", sd, ["--std", "0,0,0"], None, "expected finite values and std > 0"),
      ("under", sd, [], tmp_path / "afile" / "ckpt", "is not a writable directory")):
    r = convert(name, tensors, *flags, out=out)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
    assert not os.path.exists(str(out or tmp_path / f"out_{name}"))


@pytest.mark.parametrize("flag", ["--batch-size", "--severity", "--images", "--checkpoint-every"])
def test_builtin_run_rejects_a_zero(tmp_path, flag):
  # 0 once fell back to the flag's default (a falsy `or`), and the whole built-in benchmark ran at it.
  with pytest.raises(UserError, match=flag):
    main([flag, "0", "--output", str(tmp_path / "out"), "--no-progress"])
  assert not (tmp_path / "out" / "results.json").exists()


def run_cfg(world, out, **kw):
  base = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
              methods=("tent", "cfa"), seeds=(1,), batch_size=4, progress=False)
  return harness.RunConfig(**{**base, **kw})


def interrupted(cfg, at_save: int) -> dict:
  """Runs ``cfg`` and stops it as SIGTERM would, at its ``at_save``-th save of a unit's progress; the saved
  units (`harness_fixtures.saved_units`)."""
  calls = []
  orig = progress.Resume.save_unit

  def save(self, rec, host_state=None):
    orig(self, rec, host_state)
    calls.append(1)
    if len(calls) == at_save:
      os.kill(os.getpid(), signal.SIGTERM)
  progress.Resume.save_unit = save
  try:
    with pytest.raises(SystemExit):
      harness.run(cfg, log=lambda *a: None)
  finally:
    progress.Resume.save_unit = orig
  return hf.saved_units(cfg.output)


def test_source_data_is_checked_before_any_work(world, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  three = tmp_path / "three"  # 3 class folders that are not wnids: classes 0-2, not the head's 1000
  unreadable = tmp_path / "unreadable"
  shutil.copytree(str(world / "data" / "fog" / "5"), str(unreadable))
  for i, p in enumerate(sorted(glob.glob(str(unreadable / "*" / "*.JPEG")))):
    if i < 3:
      os.makedirs(str(three / f"class{i}"))
      shutil.copy(p, str(three / f"class{i}"))
    with open(p, "wb") as f:
      f.write(b"not a jpeg")
  for source, match in ((empty, "no class folders inside"),
                        (three, r"\(for cfa\): data has 3 class folders but the checkpoint's head has 1000"),
                        (unreadable, "none of the 8 source images cfa uses could be read")):
    lines = []
    with pytest.raises(UserError, match=f"--source-data {source}.*{match}"):
      harness.run(run_cfg(world, tmp_path / "o", source_data=str(source)), log=lines.append)
    assert not any(l.startswith("tent/seed1") for l in lines), lines  # TENT did not run first
    assert not os.path.exists(str(tmp_path / "o" / "resume"))


def test_resume_refuses_a_replaced_checkpoint(world, tmp_path):
  ckpt = copy_ckpt(world, tmp_path, "ckpt")
  cfg = dict(checkpoint=ckpt, methods=("tent",), checkpoint_every=1)
  interrupted(run_cfg(world, tmp_path / "o", **cfg), at_save=1)
  shutil.rmtree(ckpt)
  hf.make_checkpoint(ckpt, seed=1)  # re-converted weights at the same path
  with pytest.raises(UserError, match=r"the params of --checkpoint .*ckpt changed since the progress was saved"):
    harness.run(run_cfg(world, tmp_path / "o", **cfg, resume=True), log=lambda *a: None)


@pytest.mark.parametrize("change", ["corrected flag", "files changed"])
def test_resume_keeps_units_without_source_statistics_and_reruns_those_whose_changed(world, tmp_path, change):
  src_a, src_b = tmp_path / "a", tmp_path / "b"
  shutil.copytree(str(world / "data" / "gaussian_noise" / "5"), str(src_a))
  shutil.copytree(str(world / "data" / "fog" / "5"), str(src_b))
  ckpt = copy_ckpt(world, tmp_path, "ckpt")  # its own statistics cache
  kw = dict(checkpoint=ckpt, checkpoint_every=1, output=str(tmp_path / "o"))
  # TENT's two units (2 batches and the end each), CFA's first unit, the first batch of its second: CFA's second
  # unit is open.
  saved = interrupted(run_cfg(world, None, source_data=str(src_a), **kw), at_save=10)
  tent = [f"tent/seed1/{c}" for c in CORR]
  assert [k for k, r in saved.items() if r.done] == tent + [f"cfa/seed1/{CORR[0]}"]
  assert [r.progress.key for r in saved.values() if not r.done] == [f"cfa/seed1/{CORR[1]}"]
  tent_records = [rec for k in tent for rec in saved[k].records]
  assert [r["method"] for r in tent_records] == ["tent", "tent"]
  if change == "files changed":  # one more image in the source folder: 9, not 8
    one = sorted(glob.glob(str(src_a / "*" / "*.JPEG")))[0]
    shutil.copy(one, one.replace(".JPEG", "_copy.JPEG"))
    source, images = src_a, 9
  else:
    source, images = src_b, 8
  lines = []
  res = harness.run(run_cfg(world, None, source_data=str(source), resume=True, **kw), log=lines.append)
  for c in CORR:  # the finished unit and the open one
    assert any(l.startswith(f"cfa/seed1/{c}: its source statistics would differ") for l in lines), lines
  assert not any(l.startswith("tent/seed1") for l in lines)  # kept, not run again
  assert [r for r in res["records"] if r["method"] == "tent"] == tent_records
  cfa = [r for r in res["records"] if r["method"] == "cfa"]
  assert [r["corruption"] for r in cfa] == list(CORR)
  assert all(r["source_data"].startswith(f"{images} images of folder {source} ") for r in cfa), cfa


def test_fresh_run_removes_the_outputs_of_an_earlier_one_and_resume_without_progress_says_so(world, tmp_path):
  out = tmp_path / "o"
  harness.run(run_cfg(world, out, methods=("source", "tent"), save_predictions=True), log=lambda *a: None)
  pred = out / "predictions"
  assert len(list(pred.iterdir())) == 4
  (pred / "mine.npz").write_bytes(b"the user's")
  (out / "notes.txt").write_text("the user's")
  lines = []
  harness.run(run_cfg(world, out, methods=("source",), resume=True), log=lines.append)
  assert any(l.startswith("--resume: no saved progress in") for l in lines), lines
  assert sorted(os.listdir(pred)) == ["mine.npz"] and (out / "notes.txt").exists()  # no tent predictions left
  assert not (out / "gain_over_source.png").exists()  # of the earlier run: no method to compare with Source now
