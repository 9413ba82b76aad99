"""`experiments/merge_results.py`: runs of different methods over the same stream, merged into one table."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax import harness
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import merge_results

CORR = ("gaussian_noise", "fog")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One real run of Source and TENT over two seeds: its results.json and its own table."""
  world = hf.make_world(tmp_path_factory.mktemp("world"), CORR, classes=4, per_class=5)
  out = tmp_path_factory.mktemp("run")
  res = harness.run(harness.RunConfig(data=str(world / "data"), checkpoint=str(world / "ckpt"), output=str(out),
                                      corruptions=CORR, seeds=(1, 2), batch_size=8, progress=False,
                                      methods=("source", "tent")), log=lambda *a: None)
  return json.loads((out / "results.json").read_text()), res["table"]


def _split(data: dict, tmp_path, methods_per_part=(("source",), ("tent",))):
  """The run's results.json cut into one file per method set, as if each set had been its own run."""
  paths = []
  for i, ms in enumerate(methods_per_part):
    part = copy.deepcopy(data)
    part["config"]["methods"] = list(ms)
    part["records"] = [r for r in data["records"] if r["method"] in ms]
    part["throughput"] = {k: v for k, v in data["throughput"].items() if k.split("/")[0] in ms}
    d = tmp_path / f"part{i}"
    d.mkdir()
    (d / "results.json").write_text(json.dumps(part))
    paths.append(str(d))
  return paths


def test_merged_table_is_the_single_runs_table_plus_img_per_s(run, tmp_path, capsys):
  data, table = run
  paths = _split(data, tmp_path)
  assert merge_results.main([*paths, "--output", str(tmp_path / "t.md")]) == 0
  merged = (tmp_path / "t.md").read_text()
  assert capsys.readouterr().out == merged
  merged = merged.split("\n\n")[0]  # the accuracy table; the cost table after it: its own test
  got, want = merged.strip().split("\n"), table.strip().split("\n")
  assert len(got) == len(want) == 4 and "±" in want[2]  # header, rule, two methods with a spread over 2 seeds
  for g, w in zip(got, want):
    cells = g.rstrip(" |").rsplit("|", 1)
    assert cells[0] + "|" == w  # every accuracy cell as the run's own table has it
  for line, m in zip(got[2:], ("source", "tent")):
    ips = [u["images_per_s"] for k, u in data["throughput"].items() if k.startswith(m + "/")]
    cell = line.rstrip(" |").rsplit("|", 1)[1].strip()
    decimals = len(cell.partition(".")[2])
    assert len(ips) == 2 and abs(float(cell) - np.median(ips)) <= 0.5 * 10.0 ** -decimals  # the median, rounded
    assert len(cell.replace(".", "").lstrip("0")) >= 2  # to at least two significant digits


def test_img_per_s_cells_keep_two_significant_digits():
  assert [merge_results.img_per_s_cell(v) for v in (1472.4, 65.4, 10.0, 9.96, 6.72, 1.34, 0.0589, 0.0)] == [
      "1472", "65", "10", "10.0", "6.7", "1.3", "0.059", "0"]


def test_runs_of_another_stream_or_the_same_method_twice_are_refused(run, tmp_path):
  data, _ = run
  a, b = _split(data, tmp_path)
  other = json.loads((tmp_path / "part1" / "results.json").read_text())
  other["config"]["severity"] = 3
  (tmp_path / "part1" / "results.json").write_text(json.dumps(other))
  with pytest.raises(UserError, match=r"part1/results.json: severity is 3, but .*part0/results.json has 5"):
    merge_results.main([a, b])
  with pytest.raises(UserError, match=r"source seed 1 is also in"):
    merge_results.main([a, a])
  data_incomplete = dict(data, complete=False)
  (tmp_path / "inc.json").write_text(json.dumps(data_incomplete))
  with pytest.raises(UserError, match=r"inc.json: the run is not complete; finish it with --resume first"):
    merge_results.main([str(tmp_path / "inc.json")])
  with pytest.raises(UserError, match=r"nowhere: not found; expected a finished run.s folder or its results.json"):
    merge_results.main([str(tmp_path / "nowhere")])
  (tmp_path / "bad.json").write_text("[1, 2]")
  with pytest.raises(UserError, match=r"bad.json: expected a run's results.json with 'config', 'records' and 'throughput'"):
    merge_results.main([str(tmp_path / "bad.json")])


def _units(data: dict, path, units):
  """A results.json of the run's ``units`` ((method, seed) pairs) only, as if they had been a run of their own."""
  part = copy.deepcopy(data)
  part["config"]["methods"] = sorted({m for m, _ in units}, key=data["config"]["methods"].index)
  part["records"] = [r for r in data["records"] if (r["method"], r["seed"]) in units]
  part["throughput"] = {k: v for k, v in data["throughput"].items()
                        if (k.split("/")[0], int(k.split("/seed")[1])) in units}
  path.mkdir()
  (path / "results.json").write_text(json.dumps(part))
  return str(path)


def test_runs_of_other_seeds_merge_unit_by_unit_and_a_method_with_fewer_seeds_says_which(run, tmp_path):
  data, table = run
  every = {(m, s) for m in ("source", "tent") for s in (1, 2)}
  seed1 = _units(data, tmp_path / "s1", {u for u in every if u[1] == 1})
  seed2 = _units(data, tmp_path / "s2", {u for u in every if u[1] == 2})
  got = merge_results.merge([merge_results.load(seed1), merge_results.load(seed2)]).strip().split("\n")
  for g, w in zip(got, table.strip().split("\n")):
    assert g.rstrip(" |").rsplit("|", 1)[0] + "|" == w  # the one run's mean ± std, cell for cell
  fewer = _units(data, tmp_path / "fewer", {("source", 1), ("source", 2), ("tent", 1)})
  rows = merge_results.merge([merge_results.load(fewer)]).strip().split("\n")
  assert "±" in rows[2] and not rows[2].endswith(") |")  # source: both seeds
  assert "±" not in rows[3] and rows[3].endswith(" (seed 1) |")  # tent: one seed, named


def test_partial_takes_only_the_finished_units_of_a_run_under_way(run, tmp_path):
  """What the harness saves mid-run (the manifest and a record per unit, through `progress.Resume`): source's
  units all finished, tent seed 1's first corruption finished and the rest not, one of those under way.
  Only source is merged, and the units left out are named (under way or not started)."""
  from pcsr_jax import progress

  data, table = run
  resume = progress.Resume(str(tmp_path / "under_way"))
  keys = [f"{m}/seed{s}/{c}" for s in (1, 2) for m in ("source", "tent") for c in CORR]
  resume.start(dict(config_key=progress.config_key(data["config"], "digest"), data_key="d", units=keys,
                    source_keys={}))
  for r in data["records"]:
    if r["method"] == "source" or (r["seed"], r["corruption"]) == (1, CORR[0]):
      n = r["num_samples"]
      resume.save_unit(progress.UnitRecord(f"{r['method']}/seed{r['seed']}/{r['corruption']}", done=True,
                                           records=[r], curve={"seen": [n], "correct": [round(r["accuracy"] * n)]},
                                           throughput=dict(images=n, seconds=1.0, images_per_s=float(n))))
  resume.save_unit(progress.UnitRecord(f"tent/seed1/{CORR[1]}", progress=progress.UnitProgress(
      key=f"tent/seed1/{CORR[1]}", seen=48)))  # under way: its progress saved, not done
  with pytest.raises(UserError, match=r"under_way/results.json: not found"):
    merge_results.main([str(tmp_path / "under_way")])
  loaded = merge_results.load(str(tmp_path / "under_way"), partial=True)
  assert loaded["missing"] == [k for k in keys if k.startswith("tent/") and k != f"tent/seed1/{CORR[0]}"]
  line = merge_results.report_missing(loaded)
  assert f"under way: tent/seed1/{CORR[1]} (48 images in)" in line and f"not started: tent/seed2/{CORR[0]}" in line
  rows = merge_results.merge([loaded]).strip().split("\n")
  assert len(rows) == 3 and rows[2].rstrip(" |").rsplit("|", 1)[0] + "|" == table.strip().split("\n")[2]
  with open(resume.path, "w") as f:
    f.write("{}")
  with pytest.raises(UserError, match=r"progress.json: not a readable progress file \(KeyError"):
    merge_results.main([str(tmp_path / "under_way"), "--partial"])
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match=r"empty: neither results.json nor resume/progress.json"):
    merge_results.main([str(tmp_path / "empty"), "--partial"])


def test_partial_on_another_config_a_missing_folder_or_a_folder_as_output_is_one_line(run, tmp_path, capsys):
  """``--partial`` over a run under way of another stream (more images) than a finished one: the refusal alone
  (the under-way run's "not finished" line only once a table is merged); a folder that does not exist; an
  ``--output`` that is a folder or in none: one line each, before any run is read."""
  from pcsr_jax import progress

  data, _ = run
  other = dict(data["config"], limit=3)
  resume = progress.Resume(str(tmp_path / "under_way"))
  resume.start(dict(config_key=progress.config_key(other, "digest"), data_key="d", units=["tent/seed1/fog"],
                    source_keys={}))
  done = _split(data, tmp_path, (("source",),))[0]
  with pytest.raises(UserError, match=r"^\S+results.json: limit is None, but \S+progress.json has 3; merge only runs "
                                      r"of the same stream$"):
    merge_results.main([str(tmp_path / "under_way"), done, "--partial"])
  assert capsys.readouterr().err == ""
  with pytest.raises(UserError, match=r"^\S+/nowhere: not found; expected a finished run's folder"):
    merge_results.main([str(tmp_path / "nowhere"), "--partial"])
  for out, why in ((tmp_path, "expected a markdown file's path, got a folder"),
                   (tmp_path / "no" / "t.md", f"{tmp_path / 'no'} is not a folder")):
    with pytest.raises(UserError, match=f"^--output {out}: {why}$"):
      merge_results.main([done, "--output", str(out)])
  merge_results.main([done, "--output", str(tmp_path / "t.md")])
  assert (tmp_path / "t.md").read_text().startswith("| Method |")


def test_speed_takes_the_img_per_s_column_from_another_run_of_the_same_setting(run, tmp_path):
  data, table = run
  a, b = _split(data, tmp_path)
  quick = copy.deepcopy(data)  # a shorter run of both methods, timed alone: its own img/s
  quick["config"]["images_per_corruption"] = 3
  quick["throughput"] = {"source/seed1": {"images": 6, "seconds": 0.5, "images_per_s": 12.0},
                         "tent/seed1": {"images": 6, "seconds": 4.5, "images_per_s": 1.3333}}
  (tmp_path / "quick.json").write_text(json.dumps(quick))
  assert merge_results.main([a, b, "--speed", str(tmp_path / "quick.json"), "--output", str(tmp_path / "t.md")]) == 0
  rows = (tmp_path / "t.md").read_text().strip().split("\n")
  for g, w in zip(rows, table.strip().split("\n")):
    assert g.rstrip(" |").rsplit("|", 1)[0] + "|" == w  # the accuracy cells are the merged runs'
  assert rows[2].endswith(" 12 |") and rows[3].endswith(" 1.3 |")
  del quick["throughput"]["tent/seed1"]
  (tmp_path / "quick.json").write_text(json.dumps(quick))
  with pytest.raises(UserError, match=r"--speed .*quick.json: no img/s for tent; expected a run of every merged"):
    merge_results.main([a, b, "--speed", str(tmp_path / "quick.json")])
  quick["config"]["batch_size"] = 64
  (tmp_path / "quick.json").write_text(json.dumps(quick))
  with pytest.raises(UserError, match=r"--speed .*quick.json: batch_size is 64, but .*part0/results.json has 8"):
    merge_results.main([a, b, "--speed", str(tmp_path / "quick.json")])


def test_the_cost_table_takes_each_method_from_its_run_and_names_devices_and_runs(run, tmp_path, capsys):
  """Each method's cost row from the run that holds its units (or from ``--speed``), the caption naming the
  devices each was measured on (recorded with the cost) and the run it comes from; runs from before costs were
  recorded give no cost table."""
  from pcsr_jax import cost

  data, _ = run
  assert all(data["costs"][m]["devices"].endswith(" x cpu") for m in ("source", "tent"))
  a, b = _split(data, tmp_path)
  part_b = json.loads((tmp_path / "part1" / "results.json").read_text())
  part_b["costs"]["tent"] = dict(part_b["costs"]["tent"], step_s_median=0.5, devices="2 x gpu")
  (tmp_path / "part1" / "results.json").write_text(json.dumps(part_b))
  assert merge_results.main([a, b]) == 0
  costs = capsys.readouterr().out.split("\n\n", 1)[1]
  assert costs == cost.table({"source": data["costs"]["source"], "tent": part_b["costs"]["tent"]},
                             ["source", "tent"], origin={"source": f"{a}/results.json", "tent": f"{b}/results.json"})
  rows = [line for line in costs.split("\n") if line.startswith("| source") or line.startswith("| tent")]
  assert rows[1].startswith("| tent | 500.0 |")  # part1's tent, not part0's (which has no tent unit)
  assert (f"on {data['costs']['source']['devices']} (source); 2 x gpu (tent); rows from {a}/results.json (source); "
          f"{b}/results.json (tent)") in costs
  quick = copy.deepcopy(data)
  quick["costs"]["source"] = dict(quick["costs"]["source"], step_s_median=0.25)
  (tmp_path / "quick.json").write_text(json.dumps(quick))
  assert merge_results.main([a, b, "--speed", str(tmp_path / "quick.json")]) == 0
  costs = capsys.readouterr().out.split("\n\n", 1)[1]
  assert "| source | 250.0 |" in costs and f"rows from {tmp_path / 'quick.json'} (source, tent)" in costs
  for part in ("part0", "part1"):  # results.json from before costs were recorded
    old = json.loads((tmp_path / part / "results.json").read_text())
    del old["costs"]
    (tmp_path / part / "results.json").write_text(json.dumps(old))
  assert merge_results.main([a, b]) == 0
  assert "step ms" not in capsys.readouterr().out
