"""The benchmark scripts' timing loop, the GPU report's job order and the inputs both frameworks time."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import gpu_report
from benchmarks.step_throughput import _time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counting_step(seconds: float):
  calls = []

  def step():
    calls.append(time.perf_counter())
    time.sleep(seconds)

  return step, calls


@pytest.mark.parametrize("methods", [",", ""])
def test_gpu_report_refuses_an_empty_method_list_instead_of_running_every_method(methods, tmp_path):
  """``--methods ,`` and ``--methods ""``: one line, before any work folder is made (``""`` once ran every
  registered method)."""
  with pytest.raises(SystemExit, match=rf"^--methods: no method given \(got '{methods}'\)"):
    gpu_report.main(["--methods", methods, "--work", str(tmp_path / "work"), "--budget-s", "1"])
  assert not (tmp_path / "work").exists()


def test_time_runs_first_warmup_and_timed_steps_without_a_cap():
  step, calls = _counting_step(0.001)
  first_s, per_step, n = _time(step, lambda: None, steps=5, warmup=3)
  assert n == 5 and len(calls) == 1 + 3 + 5
  assert first_s >= 0.001 and per_step >= 0.001


# A step whose first calls take fresh memory (20% of the process's resident memory each, touched and kept), as
# a heap still finding room for a step's blocks does. In a fresh process (its memory is its own), from the root.
_GROWING = """
import json
import numpy as np
from benchmarks.step_throughput import _time, rss_mb
held, calls, growing = [], [], [4]
def step():
  calls.append(None)
  if growing[0] > 0:
    growing[0] -= 1
    held.append(np.ones(int(0.2 * rss_mb() * 2**20) // 8 + 1))
_, _, n = _time(step, lambda: None, steps=3, warmup=2)
out = dict(timed=n, calls=len(calls))
calls.clear()
growing[0] = 4
_time(step, lambda: None, steps=1, warmup=1, max_extra=1)
out["capped_calls"] = len(calls)
print(json.dumps(out))
"""


def test_warmup_goes_on_while_the_step_still_grows_the_process():
  r = subprocess.run([sys.executable, "-c", _GROWING], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  # first, 3 growing warm-up steps, 2 steady ones, 3 timed (a fixed warm-up of 2 would time growing steps)
  assert out["timed"] == 3 and out["calls"] == 1 + 3 + 2 + 3, out
  assert out["capped_calls"] == 1 + 2 + 1, out  # the extension is capped: warmup + max_extra, then 1 timed


def test_scripts_run_as_modules_from_the_root_without_editing_sys_path():
  """``python -m benchmarks.<name>`` from the repository root finds pcsr_jax, the `benchmarks` package and the tests'
  helpers (`tests.harness_fixtures`) with no PYTHONPATH and no script putting a folder on ``sys.path``."""
  folder = os.path.join(ROOT, "benchmarks")
  scripts = sorted(f for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")
  assert "step_throughput.py" in scripts and len(scripts) >= 9, scripts
  for f in scripts:
    with open(os.path.join(folder, f), encoding="utf-8") as src:
      assert "sys.path" not in src.read(), f
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  r = subprocess.run([sys.executable, "-m", "benchmarks.augmix_views", "--views", "0"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and r.stderr.strip() == ("augmix_views.py: error: --views and --reps must be positive "
                                                    "and --size at least 8, got 0, 3, 224"), r.stderr
  probe = "import benchmarks.end_to_end, pcsr_jax, tests.harness_fixtures as h; print(h.__file__, pcsr_jax.__file__)"
  r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [os.path.join(ROOT, "tests", "harness_fixtures.py"),
                              os.path.join(ROOT, "pcsr_jax", "__init__.py")], r.stdout


def test_time_cap_stops_warmup_and_timing_but_keeps_one_timed_step():
  step, calls = _counting_step(0.05)
  _, per_step, n = _time(step, lambda: None, steps=100, warmup=100, max_s=0.12)
  # warm-up: steps start while under 0.12 s (3 of them at 0.05 s); timing: stops once past 0.12 s (3 steps)
  assert 1 <= n <= 4, n
  assert len(calls) <= 1 + 4 + 4
  assert per_step >= 0.05
  step, calls = _counting_step(0.05)
  _, _, n = _time(step, lambda: None, steps=10, warmup=0, max_s=0.0)
  assert n == 1 and len(calls) == 2  # a cap already passed still times one step


def test_report_runs_the_slowest_methods_last_and_keeps_the_rest_in_order():
  names = ["source", "memo", "tent", "cotta", "pcsr", "foa", "adacontrast", "roid"]
  order = gpu_report.run_order(names)
  assert order[:4] == ["source", "tent", "pcsr", "roid"]
  assert order[4:] == ["foa", "cotta", "adacontrast", "memo"]


def test_the_report_parts_cover_every_method_once_within_one_gpu_command():
  """`gpu_report --part A|B|C`: together every registered method with a PyTorch reference, each once, each part
  within `PART_S` (one GPU command of 600 s with margin), MEMO at batch 16 in part C, the end to end in A only;
  a bad ``--batch-sizes`` entry is one line."""
  from pcsr_jax import methods

  parts = [gpu_report.PARTS[p]["methods"].split(",") for p in "ABC"]
  every = [m for m in methods.REGISTRY if gpu_report.has_torch_reference(m)]
  assert sorted(sum(parts, [])) == sorted(every)
  for part in "ABC":
    a = gpu_report.parser().parse_args(["--part", part, "--budget-s", "900"])
    gpu_report.apply_part(a)
    assert a.budget_s == gpu_report.PART_S <= 450 and a.reserve_s < a.budget_s
    assert (a.e2e_methods != "none") == (part == "A")
    sizes = gpu_report.batch_sizes(a, a.methods.split(","))
    assert sizes.get("memo", 64) == (16 if part == "C" else 64) and all(
        b == 64 for m, b in sizes.items() if m != "memo")
  a = gpu_report.parser().parse_args(["--batch-sizes", "memo=0"])
  with pytest.raises(SystemExit, match="^--batch-sizes: expected method=positive integer, got 'memo=0'$"):
    gpu_report.batch_sizes(a, ["memo"])


@pytest.mark.torch
def test_both_frameworks_time_the_same_weights_on_the_same_images():
  """What a step does can depend on its inputs (ROID's kept rows, EATA's filter), so the throughput
  comparison hands both frameworks `shared_inputs`: their forwards must agree (float32, BLAS tolerance)."""
  import torch

  from benchmarks.step_throughput import jax_inputs, torch_inputs

  model, params, x = jax_inputs("vit_tiny_patch32_224", 2)
  tmodel, tx = torch_inputs("vit_tiny_patch32_224", 2)
  np.testing.assert_array_equal(tx.numpy(), x.transpose(0, 3, 1, 2))
  want = model.apply({"params": params}, x)
  with torch.no_grad():
    got = tmodel(tx).numpy()
  assert np.abs(want).max() > 0.1  # the weights' scale gives logits that differ by image
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.torch
def test_dept_g_benchmark_prompts_are_the_official_size_and_the_same_for_both_frameworks():
  """DePT-G runs only with a prompts folder: the benchmarks write fresh ones of the official size with the
  checkpoint's head, and the PyTorch reference gets the very same prompts and DINO heads."""
  from benchmarks import method_args
  from benchmarks.step_throughput import jax_inputs
  from benchmarks.torch_methods.dept_g import torch_state
  from pcsr_jax import checkpoint
  from pcsr_jax.methods import dept

  model, params, _ = jax_inputs("vit_tiny_patch32_224", 2)
  assert method_args.jax_args("tent", model, params) == {} and method_args.torch_args("tent", "x") == {}
  prompt, trained, record = dept.load_prompts(method_args.jax_args("dept-g", model, params)["prompts"])
  assert (prompt.stages, prompt.prompts, prompt.dino_hidden, prompt.dino_bottleneck, prompt.dino_out) == (
      4, 50, 2048, 256, 2048)
  assert record["checkpoint_sha256"] == checkpoint.params_digest(params)
  np.testing.assert_array_equal(trained["head"]["kernel"], params["head"]["kernel"])
  t = method_args.torch_args("dept-g", "vit_tiny_patch32_224")
  assert (t["stage_num"], t["prompt_num"], t["hidden_dim"], t["bottleneck_dim"], t["out_dim"]) == (
      4, 50, 2048, 256, 2048)
  want = torch_state(trained)
  assert set(want) - set(t["state"]) == {"student.head.weight", "student.head.bias"}  # the model's own head
  for k, v in t["state"].items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)


@pytest.mark.torch
def test_dda_benchmark_unet_is_the_same_for_both_frameworks():
  """DDA runs only with a diffusion checkpoint: the benchmarks write a fresh small UNet (the built-in config) for
  JAX and load the very same weights into the PyTorch UNet, whose output then agrees with the JAX one."""
  import torch

  from benchmarks import method_args
  from pcsr_jax import checkpoint

  unet, params, meta = checkpoint.load(method_args.jax_args("dda", None, None)["unet"], kind="unet")
  assert unet.config == method_args.bench_unet() and unet.config.image_size == 32 and meta["diffusion"]["learn_sigma"]
  t = method_args.torch_args("dda", "vit_tiny_patch32_224")
  assert t["image_size"] == 32
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
  steps = np.array([505, 10], np.int32)
  want = np.asarray(unet.apply({"params": params}, x, steps))
  with torch.no_grad():
    got = t["unet"](torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(steps).long())
  assert np.abs(want).max() > 0.01  # an output that differs by input: a comparison that can fail
  np.testing.assert_allclose(got.numpy().transpose(0, 2, 3, 1), want, atol=1e-4)


def test_augmix_views_benchmark_times_both_forms_and_rejects_bad_flags(capsys):
  from benchmarks import augmix_views
  from pcsr_jax.errors import UserError

  assert augmix_views.main(["--views", "2", "--size", "16", "--reps", "1"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("AugMix views of one 16x16 image, 2 views")
  for form in ("loop", "vectorised"):
    line = next(l for l in out if form in l)
    assert float(line.split()[-1]) > 0
  with pytest.raises(UserError, match="--views and --reps must be positive"):
    augmix_views.main(["--views", "0"])


def test_rounds_alternate_which_framework_goes_first_and_keep_each_ones_fastest():
  from benchmarks.step_throughput import fastest_rounds, paired_ratios, round_order

  assert round_order(["jax", "torch"], 1) == ["jax", "torch"]
  assert round_order(["jax", "torch"], 3) == ["jax", "torch", "torch", "jax", "jax", "torch"]
  assert round_order(["torch"], 2) == ["torch", "torch"]
  runs = {"jax": [dict(images_per_s=2.0, compile_s=9.0, peak_mb=1.0), dict(images_per_s=3.0, compile_s=8.0,
                                                                             peak_mb=2.0)],
          "torch": [dict(images_per_s=5.0, compile_s=1.0, peak_mb=3.0), dict(images_per_s=4.0, compile_s=2.0,
                                                                              peak_mb=4.0)]}
  best = fastest_rounds(runs)
  assert best["jax"]["images_per_s"] == 3.0 and best["jax"]["peak_mb"] == 2.0  # the fastest round's figures
  assert best["jax"]["compile_s"] == 9.0  # the first round's compile time
  assert best["jax"]["rounds_images_per_s"] == [2.0, 3.0]
  assert best["torch"]["images_per_s"] == 5.0 and best["torch"]["rounds_images_per_s"] == [5.0, 4.0]
  # each round's own ratio (its two workers ran back to back), not the fastest rounds' 3.0 / 5.0
  assert paired_ratios(runs) == [2.0 / 5.0, 3.0 / 4.0]


def _jax_figures(out: list[str], kind: str) -> tuple[float, list[float]]:
  """The JAX line's images/s and its list of ``kind`` ("rounds" or "slices") images/s."""
  line = next(l for l in out if l.lstrip().startswith("jax"))
  every = [float(x) for x in line.split(f"({kind}: ")[1].rstrip(")").split(", ")]
  return float(line.split("]:")[1].split()[0]), every


def test_step_throughput_defaults_to_one_jax_device_per_core_on_a_cpu_only_host():
  from benchmarks.step_throughput import default_cpu_devices

  cpu = {"JAX_PLATFORMS": "cpu"}
  assert default_cpu_devices(16, cpu, cores=2) == 2  # the CPU table's setting
  assert default_cpu_devices(1, cpu, cores=2) == 1  # no device without a row
  assert default_cpu_devices(16, cpu, cores=6) == 4 and default_cpu_devices(15, cpu, cores=4) == 3
  assert default_cpu_devices(16, {"JAX_PLATFORMS": "cuda"}, cores=2) is None  # an accelerator's own devices


def test_interleaved_worker_times_one_slice_per_run_line_until_stop():
  import io

  from benchmarks.step_throughput import PROTOCOL, serve
  from pcsr_jax.errors import UserError

  step, calls = _counting_step(0.001)
  out = io.StringIO()
  first_s, per_step, n = serve(step, lambda: None, 3, 1, inp=io.StringIO("run\nrun\nstop\nrun\n"), out=out)
  answers = [json.loads(l[len(PROTOCOL):]) for l in out.getvalue().splitlines()]
  assert answers[0]["ready"] and len(answers) == 3  # ready, then one answer per slice; nothing after stop
  assert [a["steps"] for a in answers[1:]] == [3, 3] and n == 6
  assert len(calls) == 1 + 1 + 6  # first step, warm-up, two slices of 3
  assert per_step == pytest.approx(sorted(a["seconds_per_step"] for a in answers[1:])[0] / 2
                                   + sorted(a["seconds_per_step"] for a in answers[1:])[1] / 2)
  with pytest.raises(UserError, match="expected 'run' or 'stop' on stdin, got 'go'"):
    serve(step, lambda: None, 1, 0, inp=io.StringIO("go\n"), out=io.StringIO())
  with pytest.raises(UserError, match="stopped before any 'run'"):
    serve(step, lambda: None, 1, 0, inp=io.StringIO("stop\n"), out=io.StringIO())


@pytest.mark.slow
def test_step_throughput_times_rounds_of_workers_or_interleaved_slices_and_rejects_bad_counts(capsys):
  from benchmarks import step_throughput
  from pcsr_jax.errors import UserError

  base = ["--arch", "vit_tiny_patch32_224", "--batch-size", "2", "--method", "source", "--frameworks", "jax",
          "--steps", "1", "--warmup", "0"]
  assert step_throughput.main(base + ["--rounds", "2"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("fastest of 2 rounds" + step_throughput._malloc_note()), out[0]
  best, rounds = _jax_figures(out, "rounds")
  assert len(rounds) == 2 and best == max(rounds) > 0
  assert step_throughput.main(base + ["--interleave", "3"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("3 interleaved slices of 1 steps each, median slice" + step_throughput._malloc_note())
  median, slices = _jax_figures(out, "slices")
  assert len(slices) == 3 and median == sorted(slices)[1] > 0
  # a worker that fails ends the run with its own one-line error
  with pytest.raises(UserError, match="source: jax worker failed: .*--cpu-devices: expected a positive number"):
    step_throughput.main(base + ["--interleave", "3", "--cpu-devices", "0"])
  with pytest.raises(UserError, match="--interleave and --rounds: choose one"):
    step_throughput.main(base + ["--interleave", "3", "--rounds", "2"])
  for flag in ("--rounds", "--interleave"):
    with pytest.raises(UserError, match=f"{flag}: expected a positive integer, got 0"):
      step_throughput.main(base + [flag, "0"])


def test_input_pipeline_times_every_backend_on_the_same_output(capsys):
  from benchmarks import input_pipeline

  assert input_pipeline.main(["--images", "64", "--workers", "2", "--repeats", "1", "--no-grain"]) == 0
  rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines() if r.startswith("| folder")]
  got = {(r[1].strip(), r[2].strip()) for r in rows}
  assert got == {(o, p) for o in ("uint8", "float32") for p in ("loader", "loader-procs", "loader-procs-started")}
  for r in rows:
    assert float(r[4]) > 0 and r[6].strip() == "yes", r  # every pass gave the first pass's images, in order


@pytest.mark.slow
def test_profile_step_splits_a_step_by_kind_on_two_devices_in_passes(capsys, tmp_path):
  import json

  from benchmarks import profile_step

  flops = {}
  for chunk in (2, None):
    out_json = str(tmp_path / f"p{chunk}.json")
    argv = ["--arch", "vit_tiny_patch32_224", "--batch-size", "4", "--method", "tent", "--frameworks", "jax",
            "--steps", "1", "--warmup", "0", "--cpu-devices", "2", "--json", out_json]
    assert profile_step.main(argv + (["--row-chunk", str(chunk)] if chunk else [])) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "JAX on 2 CPU devices" in head and "GFLOP per step" in head, head
    assert ("passes of 2 rows" in head) == bool(chunk), head
    r = json.load(open(out_json))["results"]["jax"]
    assert r["devices"] == 2 and r["step_ms"] > 0
    assert r["memory_gib"]["argument"] > 0 and r["memory_gib"]["temp"] > 0
    # Every op is classified and counted (TENT's step is mostly the model's matmuls).
    assert set(r["kinds"]) <= set(profile_step.KINDS)
    assert r["kinds"].get("dense", 0) > max(r["kinds"].get("conv", 0), r["kinds"].get("attention", 0)), r["kinds"]
    flops[chunk] = r["flops"], r["executed_flops"]
  # The passes are unrolled (no loop whose body XLA's cost analysis would count once): the same work counted;
  # the dots and convolutions that ran (from the trace, both devices) are all of it but the elementwise ops.
  (cost2, run2), (cost1, run1) = flops[2], flops[None]
  assert cost1 > 0 and abs(cost2 / cost1 - 1) < 0.02, flops
  assert run1 > 0 and abs(run2 / run1 - 1) < 1e-9 and 0.8 * cost1 < run1 < cost1, flops


def _patch_flops(arch: str, batch: int) -> float:
  """FLOPs of a ViT's patch-embedding convolution, counted by hand from the architecture."""
  from pcsr_jax.models import get_config

  c = get_config(arch)
  return batch * 2 * c.num_patches * c.patch_size**2 * c.in_chans * c.embed_dim


def _forward_flops(arch: str, batch: int, prompts: int = 0) -> float:
  """FLOPs of a ViT forward's matmuls and patch convolution, counted by hand from the architecture."""
  from pcsr_jax.models import get_config

  c = get_config(arch)
  t, d, m = c.num_patches + 1 + prompts, c.embed_dim, c.mlp_dim
  block = 2 * t * d * 3 * d + 2 * t * d * d + 2 * 2 * t * d * m + 2 * 2 * t * t * d  # qkv, proj, fc1+fc2, QK^T+AV
  return batch * (c.depth * block + 2 * d * c.num_classes) + _patch_flops(arch, batch)


@pytest.mark.slow
def test_profile_step_counts_the_executed_work_of_every_pass_of_a_loop(capsys, tmp_path):
  import json

  from benchmarks import profile_step

  out_json = str(tmp_path / "p.json")
  argv = ["--arch", "vit_tiny_patch32_224", "--batch-size", "4", "--method", "source,foa", "--frameworks", "jax",
          "--steps", "1", "--warmup", "0", "--top", "1", "--cpu-devices", "1", "--json", out_json]
  assert profile_step.main(argv) == 0
  out = capsys.readouterr().out
  runs = {m: r["jax"]["executed_flops"] for m, r in json.load(open(out_json))["methods"].items()}
  # Source: one forward, every dot and the patch convolution as counted by hand. FOA on a CPU forwards its 28
  # candidate prompt sets one at a time in a loop (3 prompt tokens each): every iteration counted, not the body
  # once. The patch embedding runs once (the prompts join after it; XLA hoists it out of the loop); CMA-ES's
  # own small matmuls and the candidates' shifted heads add well under 1%.
  arch = "vit_tiny_patch32_224"
  patch = _patch_flops(arch, 4)
  assert runs["source"] == _forward_flops(arch, 4), runs
  loop = 28 * (_forward_flops(arch, 4, prompts=3) - patch) + patch
  assert loop <= runs["foa"] < 1.005 * loop, (runs, loop)
  assert "no cost analysis: the compiled step loops" in out.split("foa step")[1].splitlines()[0]
  rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in out.splitlines() if r.startswith("| ")}
  assert rows["source"] == f"{runs['source'] / 1e9:.1f}" and rows["foa"] == f"{runs['foa'] / 1e9:.1f}", rows


def test_profile_step_names_the_count_flag_it_refuses():
  from benchmarks import profile_step
  from pcsr_jax.errors import UserError

  for flag, value, kind in (("--steps", "0", "a positive"), ("--warmup", "-2", "a non-negative"),
                            ("--row-chunk", "0", "a positive"), ("--top", "-1", "a non-negative")):
    with pytest.raises(UserError, match=f"^{flag}: expected {kind} integer, got {value}$"):
      profile_step.main(["--arch", "vit_tiny_patch32_224", "--method", "tent", flag, value])


def test_row_chunk_ab_times_each_setting_in_turn_and_rejects_settings_that_would_run_as_one_pass(capsys):
  from benchmarks import row_chunk_ab
  from pcsr_jax.errors import UserError

  # One device, as the JAX already running in this process has (the default is one per core).
  argv = ["--arch", "vit_tiny_patch32_224", "--batch-size", "4", "--method", "tent", "--row-chunk", "none,2",
          "--steps", "2", "--warmup", "0", "--cpu-devices", "1"]
  assert row_chunk_ab.main(argv) == 0
  out = capsys.readouterr().out.splitlines()
  rows = {l.split("median")[0].strip(): l for l in out[1:]}
  assert set(rows) == {"one pass", "2 rows per pass"}, out
  assert rows["one pass"].split("), ")[1].startswith("1.000x the first")
  assert float(rows["2 rows per pass"].split("(")[1].split()[0]) > 0
  for bad, msg in (("none,3", "must be below and divide"), ("none", "at least two different"),
                   ("none,x", "positive integers or 'none'")):
    with pytest.raises(UserError, match=msg):
      row_chunk_ab.main(argv[:7] + [bad] + argv[8:])
  for flag, value, kind in (("--steps", "0", "a positive"), ("--warmup", "-1", "a non-negative")):
    with pytest.raises(UserError, match=f"^{flag}: expected {kind} integer, got {value}$"):
      row_chunk_ab.main(argv + [flag, value])


def test_alloc_steps_runs_under_the_commands_allocator_and_prints_each_steps_kernel_share():
  from pcsr_jax import malloc

  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", malloc.ENV) and not k.startswith("MIMALLOC_")}
  r = subprocess.run([sys.executable, "-m", "benchmarks.alloc_steps", "--arch", "vit_tiny_patch32_224",
                      "--batch-size", "2", "--method", "source,tent", "--steps", "2", "--warmup", "0"],
                     env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  out = r.stdout.splitlines()
  # The command restarted under the default allocator and says so.
  assert out[0].endswith("allocator: " + os.path.basename(malloc.mimalloc_library())
                         + " MIMALLOC_ARENA_MAX_OBJECT_SIZE=1024GiB"), out[0]
  temps = {}
  for m in ("source", "tent"):
    line = next(line for line in out if line.startswith(f"{m}: temporaries "))
    temps[m] = float(line.split()[2])
    assert line == f"{m}: temporaries {line.split()[2]} GiB per device", line  # far below 2 GiB here
    i = next(k for k, line in enumerate(out) if line.startswith(f"{m}: median wall"))
    cols = {line[:11].strip(): line[11:].split() for line in out[i + 1:i + 6]}
    assert set(cols) == {"wall s", "user s", "kernel s", "faults", "RSS MiB"}, out
    assert all(len(v) == 2 for v in cols.values()), out
    assert all(float(w) > 0 for w in cols["wall s"]) and all(float(k) >= 0 for k in cols["kernel s"])
  assert temps["tent"] > temps["source"], temps  # TENT's forward keeps what its backward needs
  # --steps 0: the step's memory only, nothing run or timed.
  r = subprocess.run([sys.executable, "-m", "benchmarks.alloc_steps", "--arch", "vit_tiny_patch32_224",
                      "--batch-size", "2", "--method", "tent", "--steps", "0"],
                     env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.splitlines()[1:] == [f"tent: temporaries {temps['tent']:.2f} GiB per device"], r.stdout


def test_cpu_table_cells_fit_the_machine_and_parse_as_step_throughput_flags():
  from benchmarks import cpu_table, step_throughput

  for c in cpu_table.COLUMNS:
    for m in cpu_table.METHODS:
      flags = cpu_table.cell_flags(c, m)
      if flags is None:
        assert m == "memo" and cpu_table.COLUMNS[c].batch_size == 64
        continue
      a = step_throughput.parser().parse_args(flags)
      assert a.method == m and a.arch == cpu_table.COLUMNS[c].arch
      # both workers alive at once only where they fit in 24 GiB together; rounds elsewhere
      assert (a.rounds == 2 and a.interleave is None) == ((c, m) in cpu_table.ONE_AT_A_TIME)
      assert a.batch_size == (cpu_table.COLUMNS[c].batch_size if m != "memo" else 4 if "small" in a.arch else 2)
      assert (a.row_chunk == 16) == (a.batch_size == 64 or m == "memo")
  assert cpu_table.cell_flags("vit_b16_b64", "cotta")[-2:] == ["--rounds", "2"]


@pytest.mark.torch
@pytest.mark.slow
def test_cpu_table_runs_each_cell_once_keeps_its_output_and_renders_the_paired_ratio(tmp_path, monkeypatch, capsys):
  """One real cell, DePT-G's step (the benchmark's own prompts) timed in both frameworks."""
  from benchmarks import cpu_table
  from pcsr_jax.errors import UserError

  monkeypatch.setitem(cpu_table.COLUMNS, "tiny", cpu_table.Column("ViT-Ti/32, batch 2", "vit_tiny_patch32_224", 2))
  monkeypatch.setitem(cpu_table.COLUMNS, "bad", cpu_table.Column("no such arch", "vit_nonexistent", 2))
  out = str(tmp_path / "t")
  assert cpu_table.main(["--out", out, "--columns", "tiny", "--methods", "dept-g"]) == 0
  with open(os.path.join(out, "tiny", "dept-g.json")) as f:
    res = json.load(f)["results"]
  raw = open(os.path.join(out, "raw.md")).read()
  assert raw.count("python -m benchmarks.step_throughput --arch vit_tiny_patch32_224 --method dept-g") == 1
  assert "ratio JAX / PyTorch" in raw and len(res["paired_ratios"]) == 4
  assert res["jax"]["images_per_s"] > 0 and res["torch"]["images_per_s"] > 0
  table = capsys.readouterr().out.strip().splitlines()[-3:]
  assert table[0] == "| method | per batch | ViT-Ti/32, batch 2 |"
  assert table[2] == f"| dept-g | 5F+1B | {res['paired_ratio_median']:.2f} |"
  # done cells are not run again; a cell that fails is named, leaves no JSON, and the others still render
  with pytest.raises(UserError, match=r"cells that failed .*: bad/dept-g$"):
    cpu_table.main(["--out", out, "--columns", "tiny,bad", "--methods", "dept-g"])
  raw2 = open(os.path.join(out, "raw.md")).read()
  assert raw2.startswith(raw) and raw2.count("--arch vit_tiny_patch32_224") == 1 and "(exit 2)" in raw2
  assert not os.path.exists(os.path.join(out, "bad", "dept-g.json"))
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert last == f"| dept-g | 5F+1B | {res['paired_ratio_median']:.2f} | ? |"
  with pytest.raises(UserError, match=r"--columns 'vit_s16_b16,nope': expected a comma-separated list of"):
    cpu_table.main(["--out", out, "--columns", "vit_s16_b16,nope", "--render"])


@pytest.mark.torch
def test_dpcore_benchmark_args_send_both_frameworks_down_the_same_branches():
  """The benchmarks time DPCore's known branch on both sides: with `method_args.DPCORE` every random source image
  passes the filter and every batch after the first is known (on this batch the code's own threshold keeps every
  one new), and both sides start from the same prompts and reach the same loss (float32 on one machine: 1e-4)."""
  from benchmarks import method_args
  from benchmarks.step_throughput import jax_inputs, torch_inputs
  from benchmarks.torch_reference import make_reference
  from pcsr_jax import engine, methods
  from pcsr_jax.methods.base import split
  from pcsr_jax.methods.dpcore import PROMPTS

  arch, b = "vit_tiny_patch32_224", 4
  model, params, x = jax_inputs(arch, b)
  method = methods.get("dpcore", **method_args.jax_args("dpcore", model, params), steps_new=2)
  prep = method.prepare(model, params, None, b)
  frozen, trainable = split(prep.params, prep.is_trainable)
  stats = method.compute_source_stats(prep, frozen, trainable, iter([(x, np.zeros(b, np.int32))] * 2))
  ad = engine.Adapter(method, model, params, batch_size=b, source_stats=stats)
  state, known = ad.init_state(), []
  for _ in range(3):
    state, _, m = ad.step(state, x)
    known.append(bool(m["known"]))
  tmodel, tx = torch_inputs(arch, b)
  ref = make_reference("dpcore", tmodel, b, source_batches=[tx] * 2, steps_new=2,
                       **method_args.torch_args("dpcore", arch))
  for _ in range(3):
    ref.step(tx)
  assert known == [False, True, True] and ref.branches == ["new", "known", "known"]
  assert method_args.DPCORE["thr_rho"] == ref.thr_rho == method.thr_rho
  np.testing.assert_array_equal(ref.prompt_init[0].numpy(), np.asarray(ad.prep.params[PROMPTS]["tokens"]))
  np.testing.assert_allclose(float(m["loss_prompted"]), ref.losses[-1][1], rtol=1e-4)
