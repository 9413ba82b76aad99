"""Conversion checks that need no torch: arch inference, key and shape errors, the CLI's bad-input matrix."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import golden_fixtures
from pcsr_jax import checkpoint, weights
from pcsr_jax.errors import UserError
from pcsr_jax.models import configs, create

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def zeros_state_dict(cfg):
  return {k: np.zeros(s, np.float32) for k, s in weights.expected_shapes(cfg).items()}


@pytest.mark.parametrize("arch", ["vit_tiny_patch16_224", "vit_small_patch32_384", "vit_base_patch16_384",
                                  "vit_large_patch16_224"])
@pytest.mark.parametrize("num_classes", [1000, 200])
def test_arch_inferred_from_shapes(arch, num_classes):
  cfg = configs.get_config(arch, num_classes)
  assert weights.infer_config(zeros_state_dict(cfg)) == cfg


def test_vit_base_has_timm_param_count():
  # 152 keys and 86,567,656 params in timm's vit_base_patch16_224 state dict (reference-protocols.md, sec. 6).
  shapes = weights.expected_shapes(configs.get_config("vit_base_patch16_224"))
  assert len(shapes) == 152
  assert sum(int(np.prod(s)) for s in shapes.values()) == 86_567_656


def test_missing_and_unexpected_keys_are_listed():
  cfg = configs.get_config("vit_tiny_patch16_224")
  sd = zeros_state_dict(cfg)
  del sd["blocks.3.attn.qkv.bias"]
  sd["blocks.3.attn.q_norm.weight"] = np.zeros(3)
  with pytest.raises(UserError, match=r"missing keys \['blocks.3.attn.qkv.bias'\].*unexpected keys "
                                      r"\['blocks.3.attn.q_norm.weight'\]"):
    weights.timm_to_flax(sd, cfg, "x.safetensors")


def test_shape_mismatch_names_key_and_both_shapes():
  cfg = configs.get_config("vit_tiny_patch16_224")
  sd = zeros_state_dict(cfg)
  sd["blocks.0.mlp.fc1.weight"] = np.zeros((700, 192), np.float32)
  with pytest.raises(UserError, match=r"'blocks.0.mlp.fc1.weight': checkpoint \(700, 192\), "
                                      r"vit_tiny_patch16_224 expects \(768, 192\)"):
    weights.timm_to_flax(sd, cfg)


def test_nonstandard_width_needs_arch():
  g = golden_fixtures.load(golden_fixtures.NAMES[0])
  with pytest.raises(UserError, match="not a standard timm width; pass --arch"):
    weights.infer_config(g["sd"], "f.pth")


def test_preprocessing_defaults_and_overrides():
  cfg224, cfg384 = configs.get_config("vit_base_patch16_224"), configs.get_config("vit_base_patch16_384")
  m = weights.preprocessing_meta(cfg224)
  assert m == dict(mean=[0.5] * 3, std=[0.5] * 3, interpolation="bicubic", crop_pct=0.9)
  assert weights.preprocessing_meta(cfg384)["crop_pct"] == 1.0
  m = weights.preprocessing_meta(cfg224, {"mean": (0.485, 0.456, 0.406), "crop_pct": 0.875}, crop_pct=0.95)
  assert m["mean"] == [0.485, 0.456, 0.406] and m["crop_pct"] == 0.95
  with pytest.raises(UserError, match="--mean/--std"):
    weights.preprocessing_meta(cfg224, mean=(0.5, 0.5))


@pytest.fixture(scope="module")
def golden_safetensors(tmp_path_factory):
  """A golden fixture written as .safetensors without torch (safetensors.numpy)."""
  from safetensors.numpy import save_file

  g = golden_fixtures.load(golden_fixtures.NAMES[0])
  path = str(tmp_path_factory.mktemp("st") / "model.safetensors")
  save_file({k: np.ascontiguousarray(v) for k, v in g["sd"].items()}, path)
  return g, path


def test_safetensors_to_checkpoint_round_trip(golden_safetensors, tmp_path):
  g, path = golden_safetensors
  # A nonstandard width: the shapes give everything but the head count, which a standard width would.
  sd, _ = weights.read_state_dict(path)
  cfg = g["cfg"]
  params = weights.timm_to_flax(sd, cfg, path)
  out = checkpoint.save(str(tmp_path / "ck"), params, checkpoint.make_meta(cfg, weights.preprocessing_meta(cfg)))
  model, params2, meta = checkpoint.load(out)
  assert meta["arch"] == "custom" and meta["num_classes"] == cfg.num_classes and meta["img_size"] == cfg.img_size
  assert meta["mean"] == [0.5] * 3 and meta["model"] == cfg.to_dict()
  np.testing.assert_allclose(np.asarray(model.apply({"params": params2}, g["x"])), g["logits"], atol=1e-5, rtol=1e-5)
  with pytest.raises(UserError, match="output dir exists"):
    checkpoint.save(out, params, meta)


def test_load_rejects_a_dir_that_is_not_a_checkpoint(tmp_path):
  with pytest.raises(UserError, match="not a pcsr-jax checkpoint"):
    checkpoint.load(str(tmp_path))


@pytest.mark.core
def test_convert_checkpoint_infers_standard_arch(tmp_path):
  from safetensors.numpy import save_file

  cfg = configs.get_config("vit_tiny_patch16_224", num_classes=5)
  sd = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) * 0.02
        for k, s in weights.expected_shapes(cfg).items()}
  save_file(sd, str(tmp_path / "t.safetensors"))
  res = weights.convert_checkpoint(str(tmp_path / "t.safetensors"), str(tmp_path / "out"), crop_pct=0.875)
  model, params, meta = checkpoint.load(res["out"])
  assert meta["arch"] == "vit_tiny_patch16_224" and meta["crop_pct"] == 0.875 and meta["num_classes"] == 5
  assert model.config == cfg
  back = weights.flax_to_timm(params)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k], err_msg=k)


def tiny_state_dict(seed: int = 0):
  cfg = configs.get_config("vit_tiny_patch16_224", num_classes=5)
  return {k: np.random.default_rng(seed).standard_normal(s).astype(np.float32) * 0.02
          for k, s in weights.expected_shapes(cfg).items()}


def write_pth(sd, path):
  import torch

  torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, path)


@pytest.mark.parametrize("ext", ["safetensors", pytest.param("pth", marks=pytest.mark.torch)])
def test_dataparallel_module_prefix_is_stripped_in_every_format(tmp_path, ext):
  """Keys saved from a DataParallel-wrapped model ('module.blocks.0...') convert alike from .safetensors and .pth
  (the .safetensors was refused as 'missing key patch_embed.proj.weight')."""
  from safetensors.numpy import save_file

  sd = tiny_state_dict()
  path = str(tmp_path / f"dp.{ext}")
  (save_file if ext == "safetensors" else write_pth)({f"module.{k}": v for k, v in sd.items()}, path)
  got, _ = weights.read_state_dict(path)
  assert sorted(got) == sorted(sd)
  for k in sd:
    np.testing.assert_array_equal(got[k], sd[k], err_msg=k)
  res = weights.convert_checkpoint(path, str(tmp_path / "out"))
  back = weights.flax_to_timm(checkpoint.load(res["out"])[1])
  np.testing.assert_array_equal(back["blocks.0.attn.qkv.weight"], sd["blocks.0.attn.qkv.weight"])


def test_a_key_with_and_without_the_module_prefix_is_refused(tmp_path):
  from safetensors.numpy import save_file

  sd = tiny_state_dict()
  save_file({**sd, "module.cls_token": sd["cls_token"]}, str(tmp_path / "both.safetensors"))
  with pytest.raises(UserError, match="'cls_token' and 'module.cls_token' both present"):
    weights.read_state_dict(str(tmp_path / "both.safetensors"))


def run_cli(*args, cwd=ROOT):
  return subprocess.run([sys.executable, os.path.join(ROOT, "convert_weights.py"), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=120)


def test_cli_bad_input_matrix(golden_safetensors, tmp_path):
  g, path = golden_safetensors
  bad_ext = tmp_path / "w.onnx"
  bad_ext.write_bytes(b"x")
  exists = tmp_path / "exists"
  exists.mkdir()
  from safetensors.numpy import save_file

  sd = zeros_state_dict(configs.get_config("vit_tiny_patch16_224"))
  sd["blocks.0.mlp.fc1.weight"] = np.zeros((700, 192), np.float32)
  wrong_shape = tmp_path / "wrong.safetensors"
  save_file(sd, str(wrong_shape))
  missing = len(set(weights.timm_map.expected_shapes(configs.get_config("vit_tiny_patch16_224"))) - set(g["sd"]))
  cases = {
      "no such file": ["/nonexistent/w.safetensors", "--out", str(tmp_path / "a")],
      "unsupported extension '.onnx'": [str(bad_ext), "--out", str(tmp_path / "b")],
      "unknown arch 'vit_gigantic'": [path, "--out", str(tmp_path / "c"), "--arch", "vit_gigantic"],
      f"state dict does not match vit_tiny_patch16_224 ({missing} missing, 0 unexpected): missing keys": [
          path, "--out", str(tmp_path / "d"), "--arch", "vit_tiny_patch16_224"],
      "shape mismatch for 'blocks.0.mlp.fc1.weight'": [str(wrong_shape), "--out", str(tmp_path / "g"),
                                                       "--arch", "vit_tiny_patch16_224"],
      "output dir exists": [path, "--out", str(exists), "--arch", "vit_tiny_patch16_224"],
      f"--num-classes 7 but the checkpoint's head has {g['cfg'].num_classes} classes": [
          path, "--out", str(tmp_path / "e"), "--num-classes", "7"],
      "argument --crop-pct": [path, "--out", str(tmp_path / "f"), "--crop-pct", "abc"],
  }
  for expected, args in cases.items():
    r = run_cli(*args)
    err = r.stderr.strip()
    assert r.returncode == 2, (expected, r.returncode, err)
    assert expected in err, (expected, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert not any((tmp_path / n).exists() for n in "abcdefg")


@pytest.mark.core
def test_cli_missing_keys_are_listed(tmp_path):
  from safetensors.numpy import save_file

  cfg = configs.get_config("vit_tiny_patch16_224")
  sd = zeros_state_dict(cfg)
  del sd["head.bias"], sd["blocks.11.norm2.weight"]
  save_file(sd, str(tmp_path / "m.safetensors"))
  r = run_cli(str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "o"), "--arch", "vit_tiny_patch16_224")
  assert r.returncode == 2 and "missing keys ['blocks.11.norm2.weight', 'head.bias']" in r.stderr, r.stderr


def test_recalibration_free_model_has_only_timm_params():
  cfg = configs.get_config("vit_tiny_patch16_224", num_classes=3)
  import jax

  shapes = jax.eval_shape(lambda: create(cfg).init(jax.random.key(0), np.zeros((1, 224, 224, 3), np.float32)))
  flat = weights.flax_to_timm(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes["params"]))
  assert {k: v.shape for k, v in flat.items()} == weights.expected_shapes(cfg)
