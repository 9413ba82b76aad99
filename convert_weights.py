"""Convert a timm ViT or a guided-diffusion UNet checkpoint into a pcsr-jax (Flax + orbax) checkpoint.

    python convert_weights.py SRC --out DIR [--arch NAME] [--num-classes N] [--verify]
    python convert_weights.py MODEL.pt --out DIR --unet-config JSON|NAME

SRC: a ``.safetensors``, ``.pth``/``.pt``/``.bin`` (needs torch), Google AugReg
/ big_vision ``.npz`` file, or ``timm:<model_name>[.<tag>]`` (timm's pretrained
weights; needs torch, timm and network access). See ``pcsr_jax/weights/``.

``--unet-config`` makes SRC a guided-diffusion UNet state dict (OpenAI's ``*.pt``): JSON (a file or an inline
object) takes guided-diffusion's ``model_and_diffusion_defaults()`` flags, NAME a published checkpoint's
(e.g. ``256x256_diffusion_uncond``). See docs/diffusion.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pcsr_jax import weights
from pcsr_jax.cli import run_cli
from pcsr_jax.errors import ArgumentParser, UserError


def floats(s: str) -> tuple[float, ...]:
  """Comma-separated floats (argparse turns the ValueError into a one-line error)."""
  return tuple(float(v) for v in s.split(","))


def main(argv: Sequence[str] | None = None) -> int:
  p = ArgumentParser(prog="convert_weights.py", description=__doc__.split("\n\n")[0])
  p.add_argument("src", help="checkpoint file or timm:<model_name>[.<tag>]")
  p.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
  p.add_argument("--arch", help="timm arch name, e.g. vit_base_patch16_224 (inferred from shapes if omitted)")
  p.add_argument("--num-classes", type=int, help="expected number of classes of the head")
  p.add_argument("--mean", type=floats, help="normalization mean, e.g. 0.5,0.5,0.5")
  p.add_argument("--std", type=floats, help="normalization std")
  p.add_argument("--interpolation", help="resize interpolation (bicubic, bilinear, ...)")
  p.add_argument("--crop-pct", type=float, help="center crop fraction")
  p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
  p.add_argument("--verify", action="store_true", help="compare logits with timm on a random batch (needs torch+timm)")
  p.add_argument("--unet-config", metavar="JSON|NAME",
                 help="SRC is a guided-diffusion UNet: its flags as JSON (file or object) or a published checkpoint "
                      "name, e.g. 256x256_diffusion_uncond")
  a = p.parse_args(argv)
  if a.unet_config is not None:
    return _convert_unet(a)
  result = weights.convert_checkpoint(a.src, a.out, arch=a.arch, num_classes=a.num_classes, force=a.force,
                                         verify=a.verify, mean=a.mean, std=a.std, interpolation=a.interpolation,
                                         crop_pct=a.crop_pct)
  meta = result["meta"]
  print(f"wrote {result['out']}: {meta['arch']}, {meta['num_classes']} classes, {meta['img_size']} px, "
        f"{result['num_params']:,} params, mean={meta['mean']} std={meta['std']} "
        f"{meta['interpolation']} crop_pct={meta['crop_pct']}")
  if a.verify:
    print(f"verify: max |flax - timm| logit diff = {result['max_abs_diff']:.3e} "
          f"(max |logit| {result['max_abs_logit']:.3f}, float32, matmul precision highest)")
  return 0


def _convert_unet(a: argparse.Namespace) -> int:
  """``--unet-config``: a guided-diffusion UNet state dict -> a diffusion checkpoint (docs/diffusion.md)."""
  for flag in ("arch", "num_classes", "mean", "std", "interpolation", "crop_pct", "verify"):
    if getattr(a, flag) is not None and getattr(a, flag) is not False:
      raise UserError(f"--{flag.replace('_', '-')}: not used with --unet-config (a ViT option)")
  result = weights.convert_unet(a.src, a.out, a.unet_config, force=a.force)
  meta, cfg = result["meta"], result["meta"]["model"]
  d = meta["diffusion"]
  print(f"wrote {result['out']}: guided-diffusion UNet, {cfg['image_size']} px, num_channels {cfg['num_channels']}, "
        f"channel_mult {cfg['channel_mult']}, {cfg['out_channels']} output channels, {result['num_params']:,} params; "
        f"diffusion_steps {d['diffusion_steps']}, {d['noise_schedule']} schedule, learn_sigma {d['learn_sigma']}")
  return 0


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
