"""The platform a program is built for: "cpu", "gpu" or "tpu", read from the devices it runs on (a mesh's) or
given explicitly (lowering for a GPU or TPU from a CPU host), never from ``jax.default_backend()`` while
tracing, which would bake the host's choice into a program built for another platform.

Every platform switch of the project reads this: the model's attention kernel and its CPU-only backward
passes (`models.vit.for_platform`), and the methods' own (`Prepared.platform`: FOA's candidate chunks, MEMO's
AugMix loop, DDA's UNet variants and JPEG round trip)."""

from __future__ import annotations

from typing import Any, Iterable

from pcsr_jax.errors import UserError

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
LOWERING = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}  # the names `jax.export` lowers for


def canonical(name: str) -> str:
  """"cpu", "gpu" or "tpu" for a platform or lowering name ("cuda" and "rocm" are GPUs)."""
  p = _ALIASES.get(str(name).lower(), str(name).lower())
  if p not in PLATFORMS:
    raise UserError(f"platform: expected one of {', '.join(PLATFORMS)} (or cuda, rocm), got '{name}'")
  return p


def of_devices(devices: Iterable[Any]) -> str:
  """The platform of a group of devices (all of one platform)."""
  kinds = {canonical(d.platform) for d in devices}
  if len(kinds) != 1:
    raise UserError(f"devices: expected devices of one platform, got {sorted(kinds) or 'none'}")
  return kinds.pop()


def of_mesh(mesh: Any) -> str:
  """The platform of a `jax.sharding.Mesh`'s devices."""
  return of_devices(mesh.devices.flat)
