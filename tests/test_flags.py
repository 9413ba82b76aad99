"""Every flag of every run command reaches the run's configuration, or is refused in one line.

The run commands (`imagenet_c.py` with and without --data, `imagenet_rav.py`, `wild.py`, `ablations.py`) build
their runs through one path (`experiments.common.config_from_args`). Here every flag of each command's parser is
set: the configurations that path builds hold its value (the command's own `configs`, the function its `main`
runs), or the flag gets a one-line refusal naming it. A flag added without a case here fails
`test_every_flag_has_a_case`. Real runs then show that the configuration built is the one results.json records,
flag for flag (`test_flags_reach_results_json*`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import harness_fixtures as hf
from pcsr_jax.errors import UserError
from pcsr_jax.experiments import ablations, common, imagenet_c, imagenet_rav, wild

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {"imagenet_c": imagenet_c, "imagenet_rav": imagenet_rav, "wild": wild, "ablations": ablations}
FMNIST = "/usr/share/datasets/fashion-mnist"
# Flags that configure processes and devices, not a run (`common.start_devices`): checked there (below), and
# run for real in tests/test_multiprocess.py (--coordinator, --num-processes, --process-id, --distributed's
# cluster detection) and in `test_flags_reach_results_json_builtin` (--cpu-devices).
PROCESS = ("cpu_devices", "coordinator", "num_processes", "process_id", "distributed", "heartbeat_timeout",
           "init_timeout")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("flags")
  hf.make_world(root, ("gaussian_noise", "fog"), classes=2, per_class=4)
  hf.make_imagenet_r(str(root / "imagenet-r"), classes=2, per_class=4)
  from test_data import make_visda

  make_visda(root / "visda", np.random.default_rng(1))
  np.save(root / "indices.npy", np.arange(8, dtype=np.float64))
  return root


def base_args(world, command: str, mode: str, out) -> list[str]:
  data = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt")]
  if command == "imagenet_c":
    return (["--output", str(out)] if mode == "builtin" else data + ["--output", str(out)])
  if command == "imagenet_rav":
    return ["--imagenet-r", str(world / "imagenet-r"), "--checkpoint", str(world / "ckpt"), "--output", str(out)]
  return data + ["--output", str(out)] + (["--table", "qkv"] if command == "ablations" else [])


def build(command: str, argv: list[str]) -> dict:
  mod = COMMANDS[command]
  return mod.configs(mod.parser().parse_args(argv))


def cases(world, command: str, mode: str) -> list[tuple[list[str], object]]:
  """``(flags, expected)``: ``expected`` a dict of RunConfig fields every run holds (a field of one row:
  ``"row:field"``), or the refusal's regex."""
  builtin, table = mode == "builtin", command != "imagenet_c"
  visda = str(world / "visda")
  c = [
      (["--seeds", "3,4"], {"seeds": (3, 4)}),
      (["--seeds", "3,3"], r"^--seeds: 3 given twice"),
      (["--batch-size", "16"], {"batch_size": 16}),
      (["--limit", "24"], {"limit": 24}),
      (["--limit", "-3"], r"^--limit: expected a positive integer, got -3"),
      (["--eval-order", "after"], {"eval_order": "after"}),
      (["--save-predictions"], {"save_predictions": True}),
      (["--resume"], {"resume": True}),
      (["--checkpoint-every", "3"], {"checkpoint_every": 3}),
      (["--workers", "1"], {"workers": 1}),
      (["--loader", "threads"], {"loader": "threads"}),
      (["--no-progress"], {"progress": False}),
      (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
      (["--attention", "xla"], {"attention": "xla"}),
      (["--row-chunk", "8"], {"row_chunk": 8}),
      (["--devices-per-unit", "1"], {"devices_per_unit": 1}),
      (["--devices-per-unit", "0"], r"^--devices-per-unit: expected a positive integer, got 0"),
      (["--executor", "ray"], {"executor": "ray", "ray_address": None}),
      (["--executor", "ray", "--ray-address", "auto"], {"ray_address": "auto"}),
      (["--executor", "ray", "--ray-address", "nohost"], r"^--ray-address nohost: expected HOST:PORT of the cluster"),
      (["--ray-address", "auto"], r"^--ray-address: for --executor ray"),
      (["--executor", "ray", "--ray-timeout", "45"], {"ray_timeout": 45.0}),
      (["--executor", "ray", "--ray-timeout", "0"], r"^--ray-timeout: expected a positive number of seconds, got 0"),
      (["--ray-timeout", "45"], r"^--ray-timeout: for --executor ray"),
      (["--realtime", "source"], {"realtime": "source", "realtime_cost": {}}),
      (["--realtime", "250"], {"realtime": 250.0}),
      (["--realtime", "0"], r"^--realtime: expected 'source' or a positive number of images per second, got '0'$"),
      (["--realtime-cost", "pcsr=2"], r"^--realtime-cost: fixes the costs of --realtime's protocol; give --realtime"),
      (["--cost-batches", "3"], {"cost_batches": 3}),
      (["--cost-batches", "0"], r"^--cost-batches: expected a positive integer, got 0$"),
      (["--ccc-speed", "0"], r"^--ccc-speed: expected a positive integer"),  # checked whatever the setting
      (["--ccc-length", str(10 ** 12)], r"^--ccc-length: expected a positive integer up to"),
      (["--ccc-target", "40"], r"^--ccc-target: for --setting ccc"),
      (["--ccc-speed", "8"], r"^--ccc-speed: for --setting ccc"),
      (["--ccc-length", "32"], r"^--ccc-length: for --setting ccc"),
      (["--ccc-calibration-images", "20"], r"^--ccc-calibration-images: for --setting ccc"),
      (["--imbalance-ratio", "0.5"], r"^--imbalance-ratio: expected a number >= 1"),
      (["--corruption-seed", "-1"], r"^--corruption-seed: expected an integer from 0"),
      (["--tfds-data-dir", "/x"], r"^--tfds-data-dir: " + ("needs --data" if builtin else "where TFDS data lives")),
      (["--eval-order", "both"], {"eval_order": None} if builtin else r"^--eval-order both: only for the built-in"),
      (["--output", str(world / "elsewhere")],  # a table's rows: a folder each under it
       {"output": (lambda v: os.path.dirname(v) == str(world / "elsewhere")) if table else str(world / "elsewhere")}),
  ]
  if command != "ablations":
    c += [(["--methods", "source,tent"], {"methods": ("source", "tent")}),
          (["--methods", "tent,tent"], r"^--methods: tent given twice"),
          (["--methods", ","], r"^--methods: no method given \(got ','\)"),  # not the default methods
          (["--methods", ""], r"^--methods: no method given \(got ''\)"),
          (["--methods", "source,tent", "--method-args", '{"tent": {"lr": 0.002}}'],
           {"method_args": lambda v: v["tent"]["lr"] == 0.002}),
          (["--methods", "source,tent", "--method-args", '{"sar": {"lr": 0.002}}'],
           r"^--method-args: sar is not among the methods run \(source, tent\)"),
          (["--methods", "eata", "--source-data", "fmnist-train"], {"source_data": "fmnist-train"}),
          (["--methods", "eata", "--source-data", "fmnist-train", "--source-images", "64"], {"source_images": 64}),
          (["--methods", "tent", "--source-data", "fmnist-train"], r"^--source-data: none of the methods \(tent\)"),
          (["--methods", "tent", "--source-images", "64"], r"^--source-images: none of the methods \(tent\)"),
          (["--methods", "source,tent", "--realtime", "source", "--realtime-cost", "tent=3"],
           {"realtime_cost": {"tent": 3}}),
          (["--methods", "tent", "--realtime", "source", "--realtime-cost", "sar=3"],
           r"^--realtime-cost: sar is not among the methods run \(tent\)$")]
  else:
    c += [(["--methods", "tent"], r"^--methods: set by ablations.py for each of its runs"),
          (["--source-data", "fmnist-train"], r"^--source-data: none of the methods \(pcsr\)"),
          (["--source-images", "64"], r"^--source-images: none of the methods \(pcsr\)"),
          (["--method-args", '{"pcsr": {"lr_norm": 0.002}}'],
           {"method_args": lambda v: v["pcsr"]["lr_norm"] == 0.002 and "config" in v["pcsr"]})]
  if command == "wild":
    c += [(["--setting", "continual"], r"^--setting: set by wild.py"),
          (["--imbalance-ratio", "10"], {"label_shifts:imbalance_ratio": 10}),
          (["--label-shift-indices", str(world / "indices.npy")],
           {"label_shifts:label_shift_indices": str(world / "indices.npy")}),
          (["--no-shuffle"], {"mix_shifts:shuffle": False}),  # label_shifts draws its own order
          (["--imbalance-ratio", "10", "--label-shift-indices", str(world / "indices.npy")],
           r"^--imbalance-ratio: --label-shift-indices gives the label-shift stream itself")]
  else:
    c += [(["--setting", "continual"], {"setting": "continual"}),
          (["--no-shuffle"], {"shuffle": False}),
          (["--setting", "label_shifts", "--imbalance-ratio", "10"], {"imbalance_ratio": 10}),
          (["--imbalance-ratio", "10"], r"^--imbalance-ratio: for --setting label_shifts"),
          (["--setting", "label_shifts", "--no-shuffle"], r"^--no-shuffle: --setting label_shifts draws its own"),
          (["--setting", "bs1", "--batch-size", "4"], r"^--batch-size: --setting bs1 runs batch size 1")]
    if command != "imagenet_rav":
      c += [(["--setting", "gradual", "--severity", "3"], r"^--severity: --setting gradual walks the severities")]
  if command == "imagenet_rav":
    c += [(["--data", str(world / "data")], r"^--data: set by imagenet_rav.py"),
          (["--dataset", "imagenet_a"], r"^--dataset: set by imagenet_rav.py"),
          (["--severity", "3"], r"^--severity: --dataset imagenet_r has no corruptions"),
          (["--corruptions", "fog"], r"^--corruptions: --dataset imagenet_r has no corruptions"),
          (["--image-list", "l.txt"], r"^--image-list: VisDA-2021's image list"),
          (["--visda", visda, "--image-list", "l.txt"], {"visda:image_list": "l.txt"}),
          (["--imagenet-a", str(world / "imagenet-r")], {"imagenet_a:data": str(world / "imagenet-r"),
                                                         "imagenet_a:dataset": "imagenet_a"}),
          (["--visda", visda], {"visda:data": visda, "visda:dataset": "visda"}),
          (["--checkpoint", str(world / "ckpt")], {"checkpoint": str(world / "ckpt")}),
          (["--preset", "table2"], {"seeds": (2022, 2023, 2024)}),
          (["--clean-data", str(world / "data")], r"^--clean-data generates ImageNet-C: not for --dataset"),
          (["--corrupt-on", "host"], r"^--corrupt-on: the device path corrupts --clean-data's"),
          (["--label-shift-indices", "x.npy"], r"^--label-shift-indices: for --setting label_shifts")]
    return c
  c += [(["--corruptions", "fog,fog"], r"^--corruptions: fog given twice"),
        (["--image-list", "l.txt"], r"^--image-list: " + ("needs --data" if builtin else "VisDA-2021's image list"))]
  if command == "ablations":
    c += [(["--table", "lr"], {"lr_dsn=0.02:method_args": lambda v: v["pcsr"]["lr_dsn"] == 0.02})]
  if builtin:
    c += [(["--corruptions", "fog,contrast"], {"corruptions": ("fog", "contrast")}),
          (["--severity", "4.5"], {"severity": 4.5}),
          (["--severity", "1e-10"], r"^--severity: expected a number in \[0.01, 5\]"),
          (["--images", "32"], {"images_per_corruption": 32}),
          (["--full"], {"images_per_corruption": 10000, "seeds": (2022, 2023, 2024)}),
          (["--full", "--images", "8"], r"^--full runs all 10,000 images: drop --images"),
          (["--fashion-mnist-dir", FMNIST], {"fmnist_dir": FMNIST}),
          (["--cache-dir", str(world / "cache")], {"cache_dir": str(world / "cache")}),
          (["--checkpoint", os.path.join(ROOT, "assets", "fmnist_vit")],
           {"checkpoint": os.path.join(ROOT, "assets", "fmnist_vit")}),
          (["--corruption-seed", "5"], {"corruption_seed": 5}),
          (["--setting", "ccc", "--ccc-target", "40", "--ccc-speed", "8", "--ccc-length", "32",
            "--ccc-calibration-images", "20"], {"ccc_target": 40, "ccc_speed": 8, "ccc_length": 32,
                                                "ccc_calibration_images": 20}),
          (["--setting", "ccc", "--ccc-speed", "1", "--ccc-length", "1000000"],
           r"^--ccc-speed 1: 1,000,000 walk steps over 1,000,000 images, expected at most 100,000"),
          (["--setting", "ccc", "--corruptions", "fog"], r"^--corruptions: --setting ccc walks its own"),
          (["--setting", "ccc", "--no-shuffle"], r"^--no-shuffle: --setting ccc draws its own order"),
          (["--preset", "table1"], {"methods": lambda v: len(v) > 10}),
          (["--preset", "level3"], r"^--preset level3: ImageNet-C at severity 3; it needs --data or --clean-data "
                                    r"with --checkpoint\. Without --data \(the built-in benchmark\) the one preset "
                                    r"is table1 \(every method\); for this setting on the built-in benchmark, give "
                                    r"--severity 3 instead$"),
          (["--dataset", "imagenet_c"], r"^--dataset: needs --data"),
          (["--label-shift-indices", "x.npy"], r"^--label-shift-indices: needs --data"),
          (["--corrupt-on", "device"], r"^--corrupt-on device: the device path corrupts --clean-data's images")]
    return c
  c += [(["--severity", "3"], {"severity": 3}),
        (["--severity", "4.5"], r"^--severity: expected 1 to 5 \(fractions need generated data"),
        (["--checkpoint", str(world / "ckpt")], {"checkpoint": str(world / "ckpt")}),
        (["--corruptions", "gaussian_noise,fog"], {"corruptions": ("gaussian_noise", "fog")}),
        (["--dataset", "imagenet_c"], {"dataset": "imagenet_c"}),
        (["--data", str(world / "data")], {"data": str(world / "data")}),
        (["--preset", "level3" if command == "imagenet_c" else {"wild": "wild", "ablations": "ablation"}[command]],
         {"seeds": (2022, 2023, 2024)}),
        (["--corruption-seed", "5"], r"^--corruption-seed: seeds generated corruptions"),
        (["--corrupt-on", "host"], r"^--corrupt-on: the device path corrupts --clean-data's images"),
        (["--data", "tfds", "--tfds-data-dir", "/x"], {"tfds_data_dir": "/x"})]
  if command != "wild":
    c += [(["--setting", "label_shifts", "--label-shift-indices", str(world / "indices.npy")],
           {"label_shift_indices": str(world / "indices.npy")}),
          (["--label-shift-indices", "x.npy"], r"^--label-shift-indices: for --setting label_shifts")]
  if command == "imagenet_c":  # its built-in benchmark's flags, VisDA, and the continual preset's source data
    c += [(["--preset", "continual"], r"^--source-data: dpcore needs clean source data"),
          (["--preset", "continual", "--source-data", str(world / "data")],
           {"methods": lambda v: {"rem", "dpcore", "cotta"} <= set(v), "setting": "continual"}),
          (["--images", "32"], r"^--images: the built-in benchmark's \(no --data or --clean-data\); --limit caps"),
          (["--full"], r"^--full: the built-in benchmark's"),
          (["--fashion-mnist-dir", FMNIST], r"^--fashion-mnist-dir: the built-in benchmark's"),
          (["--cache-dir", "/x"], r"^--cache-dir: the built-in benchmark's"),
          (["--dataset", "visda", "--data", visda, "--image-list", "l.txt"], {"image_list": "l.txt"}),
          (["--clean-data", str(world / "data" / "fog" / "5"), "--data", str(world / "data")],
           r"^--data and --clean-data: give one")]
  return c


def without_data(argv: list[str]) -> list[str]:
  """A base command line without its ``--data``."""
  k = argv.index("--data")
  return argv[:k] + argv[k + 2:]


def check(command, mode, world, tmp_path, flags, expected):
  argv = base_args(world, command, mode, tmp_path / "out") + flags
  if "--data" in flags and argv.count("--data") > 1:  # the case's --data replaces the base's
    argv = without_data(argv)
  if isinstance(expected, str):
    with pytest.raises(UserError, match=expected) as e:
      build(command, argv)
    assert "\n" not in str(e.value)
    return
  runs = build(command, argv)
  for key, want in expected.items():
    row, _, field = key.rpartition(":")
    for name, cfg in runs.items():
      if row and name != row:
        continue
      got = getattr(cfg, field)
      assert (want(got) if callable(want) else got == want), (flags, name, field, got, want)
    assert not row or row in runs, (flags, row, list(runs))


MODES = [("imagenet_c", "builtin"), ("imagenet_c", "data"), ("imagenet_rav", "data"), ("wild", "data"),
         ("ablations", "data")]


@pytest.mark.parametrize("command,mode", MODES)
def test_every_flag_reaches_the_config_or_is_refused(world, tmp_path, command, mode):
  for flags, expected in cases(world, command, mode):
    check(command, mode, world, tmp_path, flags, expected)


@pytest.mark.parametrize("command,mode", MODES)
def test_clean_data_flags(world, tmp_path, command, mode):
  """--clean-data and the flags of generated data: their fields, or (ImageNet-R) the refusal."""
  if command == "imagenet_rav":
    return  # in `cases`: --clean-data is refused for ImageNet-R
  clean = str(world / "data" / "fog" / "5")  # class folders of JPEGs: clean images to corrupt
  argv = without_data(base_args(world, command, "data", tmp_path / "out")) + ["--clean-data", clean]
  for flags, expected in ((["--corrupt-on", "host"], {"corrupt_on": "host", "clean_data": clean}),
                          (["--corruption-seed", "5"], {"corruption_seed": 5}),
                          (["--severity", "2.5"], {"severity": 2.5}),
                          (["--tfds-data-dir", "/x"], r"^--tfds-data-dir: where TFDS data lives")) + (
                          ((["--images", "8"], r"^--images: the built-in benchmark's"),
                           (["--cache-dir", "/x"], r"^--cache-dir: the built-in benchmark's"))
                          if command == "imagenet_c" else ()):
    if isinstance(expected, str):
      with pytest.raises(UserError, match=expected):
        build(command, argv + flags)
      continue
    for cfg in build(command, argv + flags).values():
      for field, want in expected.items():
        assert getattr(cfg, field) == want, (command, flags, field)


def test_process_flags_are_refused_outside_a_multi_process_run():
  for flag in ("--num-processes", "--process-id", "--heartbeat-timeout", "--init-timeout"):
    a = imagenet_c.parser().parse_args([flag, "2"])
    with pytest.raises(UserError, match=f"^{flag}: for a multi-process run"):
      common.start_devices(a)


def test_every_flag_has_a_case(world, tmp_path):
  """Each command's flags (its parser's) all appear in a case above, or are the process flags."""
  for command, mod in COMMANDS.items():
    dests = {a.dest for a in mod.parser()._actions if a.dest != "help"}
    covered = set(PROCESS) | {"table", "imagenet_r", "clean_data", "corrupt_on", "corruption_seed"}
    for mode in ("builtin", "data") if command == "imagenet_c" else ("data",):
      for flags, _ in cases(world, command, mode):
        covered |= {f[2:].replace("-", "_") for f in flags if f.startswith("--")}
    assert dests <= covered, (command, sorted(dests - covered))


def read_config(out) -> dict:
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


def as_json(cfg) -> dict:
  import dataclasses

  return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


@pytest.mark.slow
def test_flags_reach_results_json_builtin(tmp_path):
  """The built-in benchmark through the real CLI, many flags at once (--limit, --imbalance-ratio,
  --corruption-seed among them, which it once dropped): results.json's config is the configuration those flags
  build, field for field, and the 2 CPU devices of --cpu-devices ran it."""
  out = tmp_path / "out"
  flags = ["--methods", "source,tent", "--corruptions", "fog,contrast", "--severity", "4.5", "--seeds", "3",
           "--batch-size", "8", "--limit", "16", "--images", "32", "--setting", "label_shifts", "--imbalance-ratio",
           "10", "--eval-order", "after", "--save-predictions", "--checkpoint-every", "1", "--workers", "1",
           "--loader", "threads", "--method-args", '{"tent": {"lr": 0.002}}', "--no-progress", "--row-chunk", "4",
           "--corruption-seed", "3", "--fashion-mnist-dir", FMNIST, "--cache-dir", str(tmp_path / "cache"),
           "--attention", "xla", "--resume", "--output", str(out)]
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "imagenet_c.py"), "--cpu-devices", "2",
                      *flags], capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  res = read_config(out)
  built = as_json(build("imagenet_c", flags)[""])  # this process has one CPU device; the run had two, one group
  assert res["config"] == {**built, "devices_per_unit": 2}
  assert res["config"]["limit"] == 16 and res["config"]["imbalance_ratio"] == 10
  assert {rec["num_samples"] for rec in res["records"]} == {16}
  assert res["versions"]["devices"].count("CpuDevice") == 2


@pytest.mark.slow
def test_flags_reach_results_json_with_data(world, tmp_path):
  """--data runs (the main job and wild.py's two rows): results.json's config is each row's configuration."""
  out = tmp_path / "out"
  flags = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt"), "--corruptions",
           "gaussian_noise,fog", "--severity", "5", "--methods", "source", "--seeds", "1", "--batch-size", "4",
           "--limit", "4", "--no-shuffle", "--setting", "continual", "--no-progress", "--workers", "1", "--output",
           str(out)]
  imagenet_c.main(flags)
  assert read_config(out)["config"] == {**as_json(build("imagenet_c", flags)[""]), "devices_per_unit": 1}
  flags = ["--data", str(world / "data"), "--checkpoint", str(world / "ckpt"), "--corruptions", "fog",
           "--methods", "source", "--seeds", "1", "--batch-size", "4", "--limit", "4", "--imbalance-ratio", "10",
           "--no-progress", "--output", str(tmp_path / "wild")]
  wild.main(flags)
  for row, cfg in build("wild", flags).items():
    assert read_config(tmp_path / "wild" / row)["config"] == {**as_json(cfg), "devices_per_unit": 1}, row
  assert read_config(tmp_path / "wild" / "label_shifts")["config"]["imbalance_ratio"] == 10


def test_a_later_row_with_bad_data_stops_the_table_before_its_first_row(world, tmp_path, capsys):
  """imagenet_rav.py with a good --imagenet-r and an empty --imagenet-a: refused before ImageNet-R runs."""
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(UserError, match=f"^{empty}: data dir is empty"):
    imagenet_rav.main(["--imagenet-r", str(world / "imagenet-r"), "--imagenet-a", str(empty), "--checkpoint",
                       str(world / "ckpt"), "--methods", "source", "--seeds", "1", "--batch-size", "4",
                       "--no-progress", "--output", str(tmp_path / "rav")])
  assert not (tmp_path / "rav" / "imagenet_r" / "results.json").exists()
  assert "source/seed1" not in capsys.readouterr().out
