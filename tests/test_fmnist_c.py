"""The built-in benchmark: real Fashion-MNIST, the CIFAR-10-C-strength corruptions, the cache, the
committed source model, and a slice of the default run end to end."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import float_checks
from pcsr_jax import checkpoint, harness
from pcsr_jax.data import fashion_mnist, transforms
from pcsr_jax.data.generators import corruptions, fmnist_c
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import builtin, train_source, tune_builtin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def test_set():
  return fashion_mnist.load("test")


@pytest.mark.core
def test_fashion_mnist_is_the_real_test_set(test_set):
  x, y = test_set
  assert x.shape == (10000, 32, 32, 3) and x.dtype == np.uint8
  assert np.bincount(y).tolist() == [1000] * 10  # Fashion-MNIST's test split is balanced
  assert not x[:, :2].any() and not x[:, -2:].any() and not x[:, :, :2].any()  # the 2 px zero padding
  assert np.array_equal(x[..., 0], x[..., 2]) and x.mean() > 50  # grey replicated; real content


def test_fashion_mnist_bad_files_are_one_line_errors(tmp_path):
  with pytest.raises(UserError, match="not found"):
    fashion_mnist.load("test", str(tmp_path / "nope"))
  with pytest.raises(UserError, match="apt-get install dataset-fashion-mnist"):
    fashion_mnist.load("test", str(tmp_path))  # exists, but holds no idx files
  src = os.path.join(fashion_mnist.DEFAULT_DIR, "t10k-images-idx3-ubyte.gz")
  with gzip.open(src) as f:
    data = f.read()
  with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
    f.write(data[:-1000])
  with open(os.path.join(fashion_mnist.DEFAULT_DIR, "t10k-labels-idx1-ubyte.gz"), "rb") as f:
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(f.read())
  with pytest.raises(UserError, match="truncated idx file"):
    fashion_mnist.load("test", str(tmp_path))


@pytest.mark.parametrize("name", corruptions.ALL)
def test_every_corruption_is_seeded_per_image_and_changes_the_image(name, test_set):
  x = test_set[0][:6]
  out = corruptions.corrupt_batch(x, name, 5, seed=0, start=100)
  assert out.shape == x.shape and out.dtype == np.uint8
  assert np.abs(out.astype(int) - x).mean() > 1.0
  # Image 102 is the same whether made alone or in a batch; another seed gives another draw (if random).
  assert np.array_equal(out[2], corruptions.corrupt(x[2], name, 5, seed=0, index=102))
  if name not in corruptions.DETERMINISTIC + ("jpeg_compression", "pixelate", "contrast", "brightness",
                                               "saturate", "gaussian_blur", "defocus_blur"):
    assert not np.array_equal(out[2], corruptions.corrupt(x[2], name, 5, seed=1, index=102))


def test_severity_grows(test_set):
  x = test_set[0][:16]
  for name in ("gaussian_noise", "defocus_blur", "zoom_blur", "fog", "contrast", "pixelate", "jpeg_compression"):
    d = [np.abs(corruptions.corrupt_batch(x, name, s, 0, 0).astype(int) - x).mean() for s in (1, 3, 5)]
    assert d[0] < d[1] < d[2], (name, d)


def test_zoom_matrix_is_scipys_zoom(test_set):
  from scipy.ndimage import zoom

  img = test_set[0][7].astype(np.float32) / 255
  for f in (1.0, 1.07, 1.13, 1.25):
    ch = int(np.ceil(32 / f))
    top = (32 - ch) // 2
    ref = zoom(img[top:top + ch, top:top + ch], (f, f, 1), order=1)
    t = (ref.shape[0] - 32) // 2
    np.testing.assert_allclose(corruptions._clipped_zoom(img, f), ref[t:t + 32, t:t + 32], atol=1e-6)


def test_cache_detects_and_rebuilds_bad_entries(tmp_path, test_set):
  clean = test_set[0][:40]
  logs = []
  store = fmnist_c.Store(clean, str(tmp_path), seed=0, log=logs.append)
  pairs = [("fog", 5), ("gaussian_noise", 5)]
  first = store.get_many(pairs, 24, progress=False)
  assert any("generating 48" in m for m in logs)
  logs.clear()
  again = store.get_many(pairs, 24, progress=False)
  assert logs == [] and all(np.array_equal(first[p], again[p]) for p in pairs)
  # Extending keeps the first images and generates only the rest.
  more = store.get_many(pairs, 40, progress=False)
  assert any("generating 32" in m for m in logs)
  assert all(np.array_equal(more[p][:24], first[p]) for p in pairs)

  npy, rec = store._paths("fog", 5)
  arr = np.load(npy)
  arr[3, 10, 10, 0] ^= 0xFF  # an edited / partially written array keeps its shape
  np.save(npy, arr)
  assert "checksum mismatch" in store.check("fog", 5)[1]
  with open(npy, "r+b") as f:  # a truncated file
    f.truncate(1000)
  assert store.check("fog", 5)[0] is None and "fog_5.npy" in store.check("fog", 5)[1]
  logs.clear()
  fixed = store.get_many(pairs, 40, progress=False)
  assert any("rebuilding fog severity 5" in m for m in logs)
  assert np.array_equal(fixed[("fog", 5)], more[("fog", 5)])  # rebuilt bit-identically (seeded per image)
  os.remove(rec)  # the record is written last: without it the entry is not trusted
  assert "missing or unreadable record" in store.check("fog", 5)[1]
  with open(store._paths("gaussian_noise", 5)[1]) as f:
    meta = json.load(f)
  meta["seed"] = 7
  with open(store._paths("gaussian_noise", 5)[1], "w") as f:
    json.dump(meta, f)
  assert "seed is 7" in store.check("gaussian_noise", 5)[1]
  other = fmnist_c.Store(clean[::-1].copy(), str(tmp_path), seed=0, log=logs.append)  # other source images
  assert "source_digest" in other.check("spatter", 5)[1] or other.check("spatter", 5) == (None, "")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_while_the_cache_is_built_is_one_line_and_leaves_no_temporary_file(tmp_path, sig):
  """Ctrl-C or a scheduler's SIGTERM while the built-in benchmark builds its cache (before any unit runs): the
  command stops with ``interrupted`` (exit 130) and no half-written file in the cache (SIGTERM ended it silently,
  past its cleanup); what was finished stays, and the rerun generates only the rest."""
  import signal
  import time

  script = os.path.join(ROOT, "experiments", "imagenet_c.py")
  cmd = [sys.executable, script, "--methods", "source", "--images", "10000", "--no-progress", "--cache-dir",
         str(tmp_path / "cache"), "--output", str(tmp_path / "o")]
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's Ctrl-C
  for line in p.stdout:
    if "fmnist-c cache: generating" in line:
      break
  time.sleep(1.5)  # some corruptions written, one being generated
  p.send_signal(getattr(signal, sig))
  out, err = p.communicate(timeout=300)
  assert p.returncode == 130 and err == "interrupted\n", (p.returncode, err[-2000:])
  assert "images generated" not in out
  cache = tmp_path / "cache" / "fmnist_c"
  files = [f for _, _, fs in os.walk(cache) for f in fs]
  assert not [f for f in files if ".tmp" in f], files
  written = {f[:-len(".json")] for f in files if f.endswith(".json")}
  assert 0 < len(written) < 15 and {f[:-len(".npy")] for f in files if f.endswith(".npy")} == written


def test_committed_source_model_matches_its_record():
  model, params, meta = checkpoint.load(builtin.CHECKPOINT)
  t = meta["training"]
  assert train_source.params_digest(params) == t["params_sha256"]
  # The issue asked for >= 90%; this model reaches 89.69% (see train_source.py for what was tried).
  assert t["clean_test_accuracy"] >= 0.895 and t["train_images"] == 60000
  assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == t["n_params"] < 3_000_000


def test_train_script_is_deterministic(tmp_path):
  args = ["--epochs", "1", "--train-limit", "256", "--batch-size", "64", "--embed-dim", "32", "--depth", "1",
          "--num-heads", "2", "--eval-every", "1"]
  digests = []
  for k in range(2):
    out = tmp_path / f"ckpt{k}"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train_source.py"), "--out", str(out)]
                       + args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    digests.append(json.loads(r.stdout.strip().splitlines()[-1])["params_sha256"])
    _, params, meta = checkpoint.load(str(out))
    assert train_source.params_digest(params) == meta["training"]["params_sha256"] == digests[-1]
  assert digests[0] == digests[1]
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train_source.py"), "--out",
                      str(tmp_path / "ckpt0")] + args, capture_output=True, text=True)
  assert r.returncode == 2 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_frozen_hyperparameters_are_the_heldout_winners():
  with open(os.path.join(ROOT, "experiments", "results", "tune_builtin.json")) as f:
    sweep = json.load(f)
  assert sweep["corruptions"] == list(corruptions.HELDOUT)  # tuned on held-out corruptions only
  assert set(corruptions.BENCHMARK).isdisjoint(sweep["corruptions"])
  for m, args in sweep["winners"].items():
    assert tune_builtin.best(sweep["rows"], m) == args, m  # the rule: the paper's unless beaten beyond noise
    assert builtin.SWEPT[m] == args and builtin.METHOD_ARGS[m]["lr" if "lr" in args else "lr_fgn"] == \
        args.get("lr", args.get("lr_fgn")), m
  assert builtin.METHOD_ARGS["sar"]["reset_constant"] == builtin.METHOD_ARGS["pcsr"]["reset_constant"] == \
      pytest.approx(0.2 * np.log(10) / np.log(1000), abs=1e-4)  # SAR's threshold scaled like E0


@pytest.mark.slow
def test_builtin_slice_end_to_end(tmp_path, test_set):
  n = 192
  out = tmp_path / "run"
  cfg = builtin.run_config(str(out), images=n, corruptions=("clean", "fog", "contrast"), cache_dir=str(tmp_path),
                           progress=False)
  res = harness.run(cfg, log=lambda *_: None)
  for f in ("results.json", "results.csv", "table.md", "accuracy_per_corruption.png", "running_accuracy.png"):
    assert (out / f).stat().st_size > 0, f
  acc = {(r["method"], r["corruption"]): r["accuracy"] for r in res["records"]}
  assert {m for m, _ in acc} == set(builtin.METHODS)
  assert all(r["num_samples"] == n for r in res["records"])
  model, params, meta = checkpoint.load(builtin.CHECKPOINT)
  x = np.stack([transforms.Preprocess.from_meta(meta)(img) for img in test_set[0][:n]])
  logits = np.asarray(model.apply({"params": params}, x))  # one batch of n, not the harness's batches of 64
  float_checks.assert_accuracy_matches(acc[("source", "clean")], logits, test_set[1][:n])
  direct = float((logits.argmax(-1) == test_set[1][:n]).mean())
  assert acc[("source", "fog")] < direct and acc[("source", "contrast")] < direct


def test_builtin_cli_bad_flags_are_one_line_errors(tmp_path):
  script = os.path.join(ROOT, "experiments", "imagenet_c.py")
  for flags, msg in ((["--full", "--images", "10"], "drop --images"),
                     (["--fashion-mnist-dir", str(tmp_path / "none")], "directory not found"),
                     (["--corruptions", "rain"], "unknown corruption 'rain'"),
                     (["--preset", "level3"], "--preset level3: ImageNet-C at severity 3; it needs --data")):
    r = subprocess.run([sys.executable, script, "--output", str(tmp_path / "o"), "--cache-dir", str(tmp_path)]
                       + flags, capture_output=True, text=True)
    assert r.returncode == 2, (flags, r.stderr[-500:])
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cotta_views_fire_on_brightness_and_cost_accuracy_on_the_first_batch(capsys):
  """docs/builtin_benchmark.md's CoTTA finding, from its command: on brightness the anchor's mean confidence is
  below ``ap`` on the first batch, before any update, and the averaged views alone predict worse than the source."""
  from pcsr_jax.experiments import cotta_views

  cotta_views.main(["--images", "64", "--corruptions", "brightness"])
  row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("brightness"))
  fields = row.split()
  fired, acc_source, acc_views = fields[3], float(fields[4]), float(fields[5])
  assert fired == "1/1", row
  assert acc_views < acc_source - 10, row


def test_bad_seed_or_severity_is_refused_before_anything_is_generated(tmp_path, test_set):
  """A negative seed named a cache folder and failed in every image's SeedSequence; a severity below the
  minimum failed midway through generating (shot noise's ``lam value too large`` at 1e-300)."""
  clean = test_set[0][:8]
  for bad in (-1, 2**32):
    with pytest.raises(UserError, match=rf"^--corruption-seed: expected an integer from 0 to 4294967295, got {bad}$"):
      fmnist_c.Store(clean, str(tmp_path), seed=bad)
  logs = []
  store = fmnist_c.Store(clean, str(tmp_path), seed=0, log=logs.append)
  with pytest.raises(UserError, match=r"^severity 1e-300: expected 0 \(the clean image\) or a number from 0\.01"):
    store.get_many([("fog", 3), ("shot_noise", 1e-300)], 4, progress=False)
  assert logs == [] and not os.path.exists(store.dir)
