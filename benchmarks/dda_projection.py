"""Where DDA's projection spends its time on a CPU: the UNet's convolution and GroupNorm forms and the devices.

    python -m benchmarks.dda_projection --cpu-devices 2

Times `DDA.project` alone (the guided steps, no classifier) with the benchmarks' DDA UNet
(`benchmarks.method_args.bench_unet`: 32 px, 32 channels) and random weights, ms per group of ``--group``
images per guided step (one UNet forward and its input gradient), in one process, settings taken in turn:

* ``conv``: `pcsr_jax.models.unet.Conv`'s 'xla' (XLA's convolution) against 'dots' (im2col matmuls), on one
  device, where the steps run inside the sampler's ``fori_loop``; and, for scale, one guided step jitted alone
  and called from Python (``--steps`` times) with each;
* ``norm``: with 'dots', `pcsr_jax.models.unet.GroupNorm32`'s 'xla' (the grouped reshape, autodiff) against
  'sums' (per-channel sums, closed-form backward; what `DDA.prepare_with` picks on a CPU with 'dots'), on one
  device and on ``--cpu-devices`` devices each running its own groups;
* ``devices``: the groups on ``--cpu-devices`` devices, as the engine hands them to the method (the batch's
  rows sharded over the mesh), with each device running its own groups (`DDA.project` given the mesh: its
  ``shard_map``) against leaving the loop over groups to XLA's partitioner (the method not told the mesh).

Each setting compiles once, runs once untimed, then ``--reps`` times; the median is printed. Settings alternate
within a rep, so a slow spell of the machine lands on every setting alike.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Callable, Sequence

from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError

META = {"kind": "unet", "diffusion": {"diffusion_steps": 1000, "noise_schedule": "linear", "learn_sigma": True}}


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="dda_projection.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--cpu-devices", type=int, default=2, help="JAX devices for the 'devices' settings (default 2)")
  p.add_argument("--group", type=int, default=4, help="DDA's group: images per UNet batch (default 4, official)")
  p.add_argument("--steps", type=int, default=10, help="guided steps per image (DDA's N; default 10, official 50)")
  p.add_argument("--reps", type=int, default=3)
  a = p.parse_args(argv)
  if min(a.cpu_devices, a.group, a.steps, a.reps) < 1:
    raise UserError("--cpu-devices, --group, --steps and --reps must be positive")

  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks import method_args
  from pcsr_jax import diffusion, engine
  from pcsr_jax.methods import dda
  from pcsr_jax.models import configs, unet, vit

  engine.use_cpu_devices(a.cpu_devices)
  if jax.default_backend() != "cpu":
    raise UserError("dda_projection times the CPU backend; run it with JAX_PLATFORMS=cpu")
  cfg, params = method_args.fresh_unet()
  classifier = vit.create(configs.get_config("vit_small_patch16_224"))
  method = dda.DDA(N=a.steps, group=a.group, respacing=str(2 * a.steps))
  ndev = a.cpu_devices
  b = a.group * ndev
  y = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (b, cfg.image_size, cfg.image_size, 3)), jnp.float32)
  rows, key = jnp.ones((b,), bool), jax.random.key(0)
  one_dev, mesh = engine.data_mesh(jax.devices()[:1]), engine.data_mesh()

  def project(conv: str, mesh_given, devices, norm: str = "xla"):
    # prepare_with picks 'dots' on a CPU: put the setting's UNet back in its place.
    prep = method.prepare_with(classifier, None, unet.UNet(cfg), params, META)
    prep = dataclasses.replace(prep, unet=unet.UNet(cfg, conv=conv, norm=norm), mesh=mesh_given)
    sharding = jax.sharding.NamedSharding(devices, jax.sharding.PartitionSpec("data"))
    yy, rr = jax.device_put(y, sharding), jax.device_put(rows, sharding)
    fn = jax.jit(lambda p, yy, rr, k: method.project(prep, p, yy, rr, k))
    return lambda: fn(params, yy, rr, key).block_until_ready(), b // a.group * a.steps

  def step_from_python(conv: str):
    prep = method.prepare_with(classifier, None, unet.UNet(cfg), params, META)
    model_fn = lambda x, t: unet.UNet(cfg, conv=conv).apply({"params": params}, x, t)
    phi_y = diffusion.phi(y[:a.group], method.D)
    noise = jnp.zeros_like(y[:a.group])
    fn = jax.jit(lambda x, i: diffusion.guided_step(prep.schedule, model_fn, x, i, phi_y, noise, D=method.D,
                                                    scale=method.scale, learn_sigma=True)[0])

    def run():
      x = y[:a.group]
      for i in range(a.steps):
        x = fn(x, jnp.int32(a.steps - 1 - i))
      x.block_until_ready()

    return run, a.steps

  settings: dict[str, tuple[Callable[[], None], int]] = {
      "conv xla, 1 device, steps in the loop": project("xla", None, one_dev),
      "conv dots, 1 device, steps in the loop": project("dots", None, one_dev),
      "conv dots, norm sums, 1 device, steps in the loop": project("dots", None, one_dev, "sums"),
      "conv xla, 1 device, steps from Python": step_from_python("xla"),
      "conv dots, 1 device, steps from Python": step_from_python("dots"),
  }
  if ndev > 1:
    settings[f"conv dots, {ndev} devices, groups left to the partitioner"] = project("dots", None, mesh)
    settings[f"conv dots, {ndev} devices, each device its own groups"] = project("dots", mesh, mesh)
    settings[f"conv dots, norm sums, {ndev} devices, each device its own groups"] = project("dots", mesh, mesh, "sums")
  times: dict[str, list[float]] = {k: [] for k in settings}
  for run, _ in settings.values():
    run()  # compile and warm up
  for _ in range(a.reps):
    for name, (run, group_steps) in settings.items():
      t0 = time.perf_counter()
      run()
      times[name].append(1e3 * (time.perf_counter() - t0) / group_steps)
  print(f"DDA projection, UNet {cfg.image_size} px x {cfg.num_channels} ch, group {a.group}, {a.steps} guided steps, "
        f"jax {jax.__version__}, {a.reps} reps: ms per group per guided step (median)")
  for name, ts in times.items():
    print(f"  {name:58s} {statistics.median(ts):8.1f}   (reps: {', '.join(f'{t:.1f}' for t in ts)})")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
