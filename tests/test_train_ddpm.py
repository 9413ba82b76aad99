"""DDA's diffusion model for the built-in benchmark: `experiments/train_ddpm.py` and the committed
`assets/fmnist_ddpm`."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest

from pcsr_jax import checkpoint, files
from pcsr_jax.data import fashion_mnist
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import builtin, train_ddpm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSET = os.path.join(ROOT, "assets", "fmnist_ddpm")

# A one-level UNet (32 channels, attention in the middle block only), 4 steps of 4 images, scored on 16 held-out
# images (the held-out score dominates the run's time).
TINY = ["--num-channels", "32", "--channel-mult", "1", "--attention-resolutions", "", "--batch-size", "4",
        "--steps", "4", "--train-limit", "64", "--log-every", "2", "--checkpoint-every", "2", "--no-progress",
        "--eval-images", "16"]


def _train(out, *extra):
  assert train_ddpm.main([*TINY, "--out", str(out), *extra]) == 0


def _params(out):
  _, params, meta = checkpoint.load(str(out), kind="unet")
  return params, meta


@pytest.mark.slow
def test_training_is_deterministic_and_resumes_to_the_same_params(tmp_path):
  """4 steps straight, twice (the same bits), against 3 steps, a stop and --resume; another seed differs. The
  record holds the loss curve, the command that remakes the model in one go and the params' SHA-256."""
  _train(tmp_path / "a")
  _train(tmp_path / "b")
  _train(tmp_path / "r", "--stop-after", "3")
  assert not (tmp_path / "r" / "record.json").exists() and (tmp_path / "r" / "resume" / "state.json").exists()
  _train(tmp_path / "r", "--resume")
  _train(tmp_path / "s", "--seed", "1")
  (a, meta), (b, _), (r, _), (s, _) = (_params(tmp_path / n) for n in "abrs")
  flat = lambda p: jax.tree.leaves(p)
  for x, y, z in zip(flat(a), flat(b), flat(r)):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(x, z)
  assert any(not np.array_equal(x, y) for x, y in zip(flat(a), flat(s)))
  rec_a = json.loads((tmp_path / "a" / "record.json").read_text())
  rec_r = json.loads((tmp_path / "r" / "record.json").read_text())
  assert rec_a["params_sha256"] == rec_r["params_sha256"] == checkpoint.params_digest(a)
  assert rec_a["held_out_eps_mse"] == rec_r["held_out_eps_mse"] and rec_a["held_out_eps_mse"]["images"] == 16
  assert rec_a["history"] == rec_r["history"] and [h["step"] for h in rec_a["history"]] == [2, 4]
  assert all(np.isfinite(h["loss"]) and h["loss"] == pytest.approx(h["mse"] + h["vb"], abs=1e-4)
             for h in rec_a["history"])
  assert [(x["start_step"], x["end_step"]) for x in rec_r["sessions"]] == [(0, 3), (3, 4)]
  assert rec_r["command"] == rec_a["command"].replace(str(tmp_path / "a"), str(tmp_path / "r"))
  assert "--resume" not in rec_r["command"] and "--stop-after" not in rec_r["command"]
  assert meta["diffusion"]["learn_sigma"] and meta["training"]["params_sha256"] == rec_a["params_sha256"]
  for extra in ((), ("--resume",)):
    with pytest.raises(UserError, match=r"holds a trained model already"):
      _train(tmp_path / "a", *extra)
  with pytest.raises(UserError, match=r"--resume: no saved progress"):
    _train(tmp_path / "none", "--resume")


def test_resume_refuses_another_run_and_a_damaged_state(tmp_path):
  """A state saved under other settings (its run key) or a damaged one: one line, no training."""
  a = train_ddpm.parse([*TINY, "--out", str(tmp_path / "r")])
  resume = str(tmp_path / "r" / "resume")
  trainer = train_ddpm.Trainer(train_ddpm.unet_config(a), seed=0, lr=a.lr, ema_rate=a.ema_rate)
  files.save_trainer(resume, trainer, train_ddpm.FORMAT_STATE, dict(key=train_ddpm.run_key(a), step=1, history=[],
                                                                    partial={}, sessions=[], seconds=0.0))
  with pytest.raises(UserError, match=r"saved by a run with other settings"):
    _train(tmp_path / "r", "--resume", "--lr", "0.001")
  with open(os.path.join(resume, "state.npz"), "wb") as f:
    f.write(b"not an npz")
  with pytest.raises(UserError, match=r"saved state is damaged or missing"):
    _train(tmp_path / "r", "--resume")


@pytest.mark.parametrize("flag, value, match", [
    ("--steps", "0", "--steps: expected a positive integer"),
    ("--ema-rate", "1", "--ema-rate: expected a value in"),
    ("--ema-rate", "nan", "--ema-rate: expected a value in"),
    ("--eval-images", "0", "--eval-images: expected a positive integer"),
    ("--channel-mult", "1,x", "--channel-mult: expected comma-separated numbers"),
    ("--channel-mult", "1,nan", "--channel-mult: expected comma-separated numbers > 0"),
    ("--attention-resolutions", "0", "--attention-resolutions: expected comma-separated numbers > 0"),
    ("--attention-resolutions", "7", r"--attention-resolutions: \[7\] px is not a resolution of this UNet \(its "
                                     r"levels: \[32, 16, 8\] px"),
    ("--num-channels", "48", "not a multiple of 32"),
    ("--seed", "-1", r"--seed: expected an integer in \[0, 4294967295\], got -1"),
    ("--seed", str(2 ** 32), r"--seed: expected an integer in \[0, 4294967295\], got 4294967296"),
    ("--lr", "inf", "--lr: expected a number > 0, got inf"),
    ("--batch-size", "100", "--batch-size 100: more than the 64 training images"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, flag, value, match):
  """Each before a step is taken (the run's first line, the UNet's size, is not printed)."""
  with pytest.raises(UserError, match=match):
    train_ddpm.main(["--out", str(tmp_path / "o"), "--train-limit", "64", flag, value])
  assert "train_ddpm: UNet" not in capsys.readouterr().out and not (tmp_path / "o").exists()


def test_out_that_is_a_file_or_under_one_is_refused_before_training(tmp_path, capsys):
  """The model is written next to --out and renamed over it: a file in the way would be found only after
  training (a `NotADirectoryError`); refused first, in one line, with nothing made."""
  f = tmp_path / "file"
  f.write_text("x")
  for out, match in ((f, "exists and is not a directory"), (f / "sub", f"{f} exists and is not a directory")):
    with pytest.raises(UserError, match=f"^--out {re.escape(str(out))}: {re.escape(match)}$"):
      _train(out)
  assert capsys.readouterr().out == "" and f.read_text() == "x"


@pytest.mark.slow
def test_a_diverging_run_stops_at_its_first_non_finite_loss(tmp_path):
  """--lr 1e30: AdamW's first update moves every weight by ~1e30, so step 2's loss is not finite: one line
  naming step 2 and --lr, no model or record written, and the state saved for --resume is step 1's."""
  with pytest.raises(UserError, match=r"^training diverged at step 2: non-finite loss \((nan|inf)\); nothing was "
                                      r"written as finished; try a lower --lr than 1e\+30$"):
    _train(tmp_path / "o", "--lr", "1e30", "--checkpoint-every", "1")
  assert sorted(os.listdir(tmp_path / "o")) == ["resume"]
  assert json.loads((tmp_path / "o" / "resume" / "state.json").read_text())["step"] == 1


@pytest.mark.slow
def test_resume_before_the_saved_step_is_refused(tmp_path):
  """--steps 6 --stop-after 5, then --resume --steps 2: the saved state holds 5 steps, so finishing would write
  a model of 5 steps recorded (and reproduced) as 2: refused in one line naming both, nothing finished.
  --resume --steps 5 then finishes at once, recorded as 5 steps, its curve ending at step 5."""
  _train(tmp_path / "r", "--steps", "6", "--stop-after", "5")
  with pytest.raises(UserError, match=r"^--steps 2: the saved state in .*resume is at step 5, after it; resume with "
                                      r"--steps 5 or more"):
    _train(tmp_path / "r", "--resume", "--steps", "2")
  assert not (tmp_path / "r" / "record.json").exists()
  _train(tmp_path / "r", "--resume", "--steps", "5")
  rec = json.loads((tmp_path / "r" / "record.json").read_text())
  assert rec["steps"] == 5 and rec["command"].endswith("--steps 5")
  assert [h["step"] for h in rec["history"]] == [2, 4, 5]
  assert [(x["start_step"], x["end_step"]) for x in rec["sessions"]] == [(0, 5), (5, 5)]


def test_reproducing_command_drops_the_session_flags():
  cmd = train_ddpm.reproducing_command(["--out", "x y", "--resume", "--stop-after", "3", "--stop-after=2", "--force",
                                        "--steps", "9"])
  assert cmd == "python experiments/train_ddpm.py --out 'x y' --steps 9"


# ---------------------------------------------------------------- the committed asset

@pytest.fixture(scope="module")
def asset():
  model, params, meta = checkpoint.load(ASSET, kind="unet")
  with open(os.path.join(ASSET, "record.json")) as f:
    record = json.load(f)
  return model, params, meta, record


def test_the_asset_loads_and_its_record_matches_its_params(asset):
  model, params, meta, record = asset
  assert builtin.METHOD_ARGS["dda"]["unet"] == ASSET
  assert record["params_sha256"] == checkpoint.params_digest(params) == meta["training"]["params_sha256"]
  assert record["unet"] == model.config.to_dict() == meta["model"]
  assert meta["diffusion"]["diffusion_steps"] == 1000 and meta["diffusion"]["noise_schedule"] == "linear"
  assert record["command"].startswith("python experiments/train_ddpm.py")
  assert record["history"][-1]["step"] == record["steps"]
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ASSET) for f in fs)
  assert size < 8e6, f"{size / 1e6:.1f} MB: keep the asset small"


def test_the_asset_denoises_held_out_images(asset):
  """At t = 500 (alpha_bar 0.08) the eps-MSE on 64 Fashion-MNIST test images is well below that of predicting
  zero (about 1); a random model of the same config is not (the property is not one every UNet has)."""
  model, params, _, _ = asset
  x, _ = fashion_mnist.load("test")
  images = x[-64:].astype(np.float32) / 127.5 - 1.0  # the test split's last images: never trained on
  trained = train_ddpm.eps_mse(model, params, images, (500,), seed=1)[500]
  random_params = model.init(jax.random.key(3), images[:1], np.zeros((1,), np.int32))["params"]
  untrained = train_ddpm.eps_mse(model, random_params, images, (500,), seed=1)[500]
  zero = train_ddpm.eps_mse(model, jax.tree.map(np.zeros_like, params), images, (500,), seed=1)[500]
  assert 0.9 < zero < 1.1  # the zero model's output is zero: the noise's own mean square
  assert trained < 0.3 * zero, (trained, zero)
  assert untrained > 0.7 * zero, untrained


def test_builtin_runs_dda_with_the_asset_at_the_official_noise_level():
  """The built-in run's DDA: the committed UNet, 8 steps from t = 504 (the official 505) and 64 images per
  corruption by default; --full the official 100 / 50 (t = 505, 50 steps) on the same UNet."""
  from pcsr_jax import checkpoint, diffusion, methods

  model, params, _ = checkpoint.load(builtin.CHECKPOINT)
  assert builtin.default_images(builtin.METHODS) == builtin.DEFAULT_IMAGES
  assert builtin.default_images(("source", "dda")) == 64
  quick, full = builtin.frozen_method_args(("dda",))["dda"], builtin.frozen_method_args(("dda",), full=True)["dda"]
  assert quick == {"unet": ASSET, "respacing": "ddim16", "N": 8}
  assert full == {"unet": ASSET, "respacing": "100", "N": 50}
  for args, t in ((quick, 504), (full, 505)):
    m = methods.get("dda", **args)
    m.check_inputs(model, params, builtin.BATCH_SIZE)
    assert (m.D, m.scale) == (4, 6.0)
    assert diffusion.make_schedule(1000, "linear", m.respacing).timestep_map[m.N] == t
