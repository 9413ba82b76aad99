"""Table 1's baselines through the harness: every setting, source statistics from --source-data, and resume.

On the generated ImageNet-C folders and the tiny 1000-class checkpoint of `harness_fixtures`. The clean
"source data" is one corruption's folder (it has the ImageNet layout: ``<wnid>/*.JPEG``).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import harness, methods, source_stats
from pcsr_jax.data import streams
from pcsr_jax.errors import UserError
from tiny import required_args

CORR = ("gaussian_noise", "fog")
# Every baseline whose step is a method file (source, tent, sar, pcsr are tested elsewhere): part 1, and part 2
# (the methods that augment on the device), the latter with fewer views so that the test stays quick.
BASELINES = ("t3a", "eta", "eata", "deyo", "cfa", "foa")
AUGMENTING = ("cotta", "roid", "cmf", "spa", "memo", "adacontrast")
FEWER_VIEWS = {"memo": {"views": 4, "chunk": 4}, "cotta": {"n_aug": 4, "ap": 0.5}, "adacontrast": {"queue_size": 64}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return hf.make_world(tmp_path_factory.mktemp("baselines"), CORR, classes=4, per_class=5)


def cfg(world, out, **kw):
  base = dict(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out), corruptions=CORR,
              seeds=(1,), batch_size=8, progress=False, methods=BASELINES,
              source_data=str(world / "data" / "gaussian_noise" / "5"))
  base.update(kw)
  return harness.RunConfig(**base)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [s for s in streams.SETTINGS if s not in ("gradual", "ccc")])  # own tests
@pytest.mark.parametrize("group", ["part1", "augmenting"])
def test_every_baseline_in_every_setting(world, tmp_path, setting, group):
  names = BASELINES if group == "part1" else AUGMENTING
  lines = []
  res = harness.run(cfg(world, tmp_path, setting=setting, limit=16, methods=names, method_args=FEWER_VIEWS),
                    log=lines.append)
  recs = res["records"]
  assert sorted({r["method"] for r in recs}) == sorted(names)
  totals = set()
  for m in names:
    mine = [r for r in recs if r["method"] == m]
    assert [r["corruption"] for r in mine] == list(CORR), (m, mine)
    assert all(r["setting"] == setting and 0 <= r["accuracy"] <= 1 for r in mine)
    if setting in ("normal", "continual", "bs1"):  # --limit: the first 16 images of each corruption
      assert [r["num_samples"] for r in mine] == [16, 16], (m, mine)
    totals.add(sum(r["num_samples"] for r in mine))
  assert len(totals) == 1 and totals.pop() > 0  # every method saw the same stream
  used = {r["method"]: r["source_data"] for r in recs}
  if group == "part1":
    assert used["t3a"] == used["eta"] == used["deyo"] == "none"
    assert used["eata"].startswith("20 images of folder") and used["cfa"] == used["foa"] == used["eata"]
  else:
    assert set(used.values()) == {"none"}


def test_source_statistics_are_computed_once_and_reused(world, tmp_path):
  ckpt = str(tmp_path / "ckpt")  # a copy of the checkpoint: its statistics cache starts empty
  shutil.copytree(str(world / "ckpt"), ckpt)
  lines = []
  harness.run(cfg(world, tmp_path / "a", methods=("eata", "cfa"), limit=8, checkpoint=ckpt), log=lines.append)
  assert sum("computing source statistics" in l for l in lines) == 2, lines
  assert os.path.isdir(ckpt + ".source_stats")
  lines = []
  harness.run(cfg(world, tmp_path / "b", methods=("eata", "cfa"), limit=8, checkpoint=ckpt), log=lines.append)
  assert sum("source statistics from" in l for l in lines) == 2 and not any("computing" in l for l in lines)


def test_without_source_data_eata_runs_as_eta_and_says_so(world, tmp_path):
  lines = []
  res = harness.run(cfg(world, tmp_path / "e", methods=("eata", "eta"), source_data=None, limit=16),
                    log=lines.append)
  assert any("eata: no --source-data; running its source-free form" in l for l in lines)
  by = {(r["method"], r["corruption"]): r for r in res["records"]}
  for c in CORR:  # the same numbers as ETA, and the records say what ran
    assert by[("eata", c)]["accuracy"] == by[("eta", c)]["accuracy"]
    assert by[("eata", c)]["source_data"].startswith("none: source-free form")
  for m in ("cfa", "foa"):
    with pytest.raises(UserError, match=f"--source-data: {m} needs clean source data"):
      harness.run(cfg(world, tmp_path / m, methods=(m,), source_data=None), log=lambda *a: None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(methods.REGISTRY))
def test_state_resumes_bit_identically_from_the_host_copy(world, name):
  """What the harness checkpoints (the state on the host) continues exactly like the uninterrupted stream."""
  from pcsr_jax import checkpoint
  from pcsr_jax.engine import Adapter

  model, params, meta = checkpoint.load(str(world / "ckpt"))
  method = methods.get(name, **required_args(name, model, params))
  stats = None
  if method.uses_source_data():
    data = source_stats.open_source_data(str(world / "data" / "fog" / "5"), meta)
    stats, _ = source_stats.get(method, model, params, data, checkpoint_dir=str(world / "ckpt"),
                                output_dir=str(world / "out"), batch_size=4, progress=False, log=lambda *a: None)
  ad = Adapter(method, model, params, batch_size=4, source_stats=stats, seed=3)
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal((4, 32, 32, 3)).astype(np.float32) for _ in range(4)] + \
       [rng.standard_normal((3, 32, 32, 3)).astype(np.float32)]
  straight, state = [], ad.init_state()
  for x in xs:
    state, logits, _ = ad.step(state, x)
    straight.append(np.asarray(logits))
  resumed, state = [], ad.init_state()
  for i, x in enumerate(xs):
    if i == 2:  # save and restore as the harness does
      state = ad.state_from_host(jax.tree.map(np.copy, ad.state_to_host(state)))
    state, logits, _ = ad.step(state, x)
    resumed.append(np.asarray(logits))
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(a, b)


def test_records_name_each_methods_source_data_in_results_json(world, tmp_path):
  harness.run(cfg(world, tmp_path, methods=("t3a", "cfa"), limit=8), log=lambda *a: None)
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["config"]["source_data"].endswith(os.path.join("gaussian_noise", "5"))
  assert {r["method"]: r["source_data"] for r in data["records"]}["t3a"] == "none"
