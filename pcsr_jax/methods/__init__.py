"""Online TTA methods, one file each, all implementing `base.Method`.

``get(name, **hyperparameters)`` builds one by its registry name. A registry
entry is a `Method` class and the overrides that make a variant of it
(``pcsr-frozen`` is `PCSR` with ``recipe='frozen'``), so variants run side by
side under their own names. To add a method, write a `Method` subclass in a
new file and add a line to ``REGISTRY``; a method defined outside this package
joins with ``register(name, cls)``, or from any command with
``--methods package.module:Class`` (`load`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import traceback
import typing

from pcsr_jax.errors import UserError, check_fields
from pcsr_jax.method_names import did_you_mean
from pcsr_jax.methods.base import AdaptState, Method, Prepared
from pcsr_jax.methods.adacontrast import AdaContrast
from pcsr_jax.methods.cfa import CFA
from pcsr_jax.methods.cmf import CMF
from pcsr_jax.methods.cotta import CoTTA
from pcsr_jax.methods.dct import DCT
from pcsr_jax.methods.dda import DDA
from pcsr_jax.methods.dept import DePTG
from pcsr_jax.methods.dpal import DPAL
from pcsr_jax.methods.dpcore import DPCore
from pcsr_jax.methods.deyo import DeYO
from pcsr_jax.methods.eata import EATA
from pcsr_jax.methods.foa import FOA
from pcsr_jax.methods.fozo import FOZO
from pcsr_jax.methods.imse import IMSE
from pcsr_jax.methods.memo import MEMO
from pcsr_jax.methods.neo import NEO
from pcsr_jax.methods.pcsr import PCSR
from pcsr_jax.methods.pea import PEA
from pcsr_jax.methods.roid import ROID
from pcsr_jax.methods.rem import REM
from pcsr_jax.methods.sar import SAR
from pcsr_jax.methods.source import Source
from pcsr_jax.methods.spa import SPA
from pcsr_jax.methods.t3a import T3A
from pcsr_jax.methods.tent import Tent
from pcsr_jax.methods.vct import VCT
from pcsr_jax.methods.zerosiam import ZeroSiam

REGISTRY: dict[str, tuple[type[Method], dict]] = {
    "source": (Source, {}),
    "tent": (Tent, {}),
    "sar": (SAR, {}),
    "cotta": (CoTTA, {}),
    "memo": (MEMO, {}),
    "adacontrast": (AdaContrast, {}),
    "pcsr": (PCSR, {}),  # the authors' recipe: SAR's base + PCSR's modules
    "pcsr-frozen": (PCSR, {"recipe": "frozen"}),  # the paper's text alone: backbone frozen, plain SGD
    "t3a": (T3A, {}),
    "eta": (EATA, {"fisher_alpha": 0.0}),  # EATA without the Fisher regularizer: no source data
    "eata": (EATA, {}),
    "deyo": (DeYO, {}),
    "cfa": (CFA, {}),
    "foa": (FOA, {}),
    "spa": (SPA, {}),
    "roid": (ROID, {}),
    "cmf": (CMF, {}),
    "dept-g": (DePTG, {}),  # needs prompts trained on source: experiments/train_prompts.py
    "dda": (DDA, {}),  # needs a diffusion checkpoint: convert_weights.py --unet-config
    # COME (ICLR 2025) on its three hosts: their steps with COME's entropy over K+1 entries
    "tent-come": (Tent, {"loss": "come"}),
    "sar-come": (SAR, {"loss": "come"}),
    "eata-come": (EATA, {"loss": "come"}),
    # PCSR's authors' earlier methods on SAR's code base
    "vct": (VCT, {}),  # a per-slot instance token on the class token; predicts after the update
    "dct": (DCT, {}),  # a generated q/k/v token in blocks 0-8's attention
    "dpal": (DPAL, {}),  # prompts and per-block noise predictors; predicts at SAM's perturbed weights
    "zerosiam": (ZeroSiam, {}),  # ICLR 2026: an identity-initialised predictor before the head
    "rem": (REM, {}),  # ICML 2025, continual: masked views of the least-attended patches, ranked entropies
    "dpcore": (DPCore, {}),  # ICML 2025, continual: a coreset of domain statistics and prompts; --source-data
    "neo": (NEO, {}),  # ICLR 2026: no parameter adapted, the embeddings re-centred before the head
    "pea": (PEA, {}),  # ICLR 2026: every block's tokens aligned to source statistics (CORAL), 6F, no backward
    "imse": (IMSE, {}),  # ICLR 2026: the singular values of every block Linear; a pool of experts; --source-data
    "fozo": (FOZO, {}),  # CVPR 2026: FOA's prompts tuned by zeroth-order (SPSA) estimates, 2F; --source-data
}


def register(name: str, cls: type[Method], **overrides) -> str:
  """Adds ``cls`` (a frozen `Method` dataclass) to the registry as ``name``, with the field ``overrides`` that make
  it a variant (as ``pcsr-frozen``); every command then runs it by that name. Registering the same class and
  overrides again is a no-op; another method under a taken name is refused. Returns ``name``."""
  if not (isinstance(cls, type) and issubclass(cls, Method) and dataclasses.is_dataclass(cls)):
    raise UserError(f"method {name}: {cls!r} is not a dataclass subclassing pcsr_jax.methods.Method")
  if not name or any(c in name for c in "/,: "):
    raise UserError(f"method name {name!r}: expected a non-empty name without '/', ',', ':' or spaces")
  if name in REGISTRY and REGISTRY[name] != (cls, overrides):
    raise UserError(f"method {name}: the name is taken by {REGISTRY[name][0].__module__}."
                    f"{REGISTRY[name][0].__qualname__}")
  check_fields(cls, overrides, name, "unknown hyperparameters")
  REGISTRY[name] = (cls, dict(overrides))
  return name


def load(spec: str) -> str:
  """``package.module:Class`` (``--methods``): imports the module, registers its `Method` class under the class's
  own ``name`` (`register`) and returns that name; a registered name comes back as it is. The module is looked
  up on ``sys.path`` and, after it, in the current folder (as ``python -m`` would: a ``my_methods.py`` beside
  where the command runs)."""
  if ":" not in spec:
    return spec
  module, _, attr = spec.partition(":")
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())
  try:
    found = importlib.import_module(module)
  except ImportError as e:
    raise UserError(f"--methods {spec}: cannot import {module} ({type(e).__name__}: {e})") from None
  except SyntaxError as e:  # IndentationError too: the module's own file and line, not the import machinery's
    raise UserError(f"--methods {spec}: cannot import {module}: {e.filename}:{e.lineno}: "
                    f"{type(e).__name__}: {e.msg}") from None
  except Exception as e:  # the module's code raised as it ran: where, in its own file
    raise UserError(f"--methods {spec}: cannot import {module}: {_raised_at(e)}: {type(e).__name__}: "
                    f"{_one_line(e)}") from None
  try:
    cls = getattr(found, attr)
  except AttributeError:
    raise UserError(f"--methods {spec}: {module} has no {attr}") from None
  name = getattr(cls, "name", None)
  if not isinstance(name, str):
    raise UserError(f"--methods {spec}: expected a Method class with a `name` (ClassVar[str]), got {cls!r}")
  return register(name, cls)


def _raised_at(e: BaseException) -> str:
  """``file:line`` of the statement of an imported module's own file that raised ``e`` while the module ran (the
  deepest frame in that file: the module's line, not a library's it called), past the import machinery."""
  machinery = (__file__, importlib.__file__)
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if f.filename not in machinery and not f.filename.startswith("<frozen ")]
  if not frames:
    return "?"
  mine = [f for f in frames if f.filename == frames[0].filename]
  return f"{mine[-1].filename}:{mine[-1].lineno}"


def _one_line(e: BaseException) -> str:
  """An exception's message on one line (its lines joined), or its type when it has none."""
  return " / ".join(line.strip() for line in str(e).splitlines() if line.strip()) or "(no message)"


def origin(name: str) -> str:
  """Where the registered method ``name`` comes from, as ``module:Class`` (results.json records it)."""
  cls = REGISTRY[name][0]
  return f"{cls.__module__}:{cls.__qualname__}"


def get(name: str, **hyperparameters) -> Method:
  """The method registered as ``name`` with the given hyperparameters (over the variant's overrides)."""
  if name not in REGISTRY:
    raise UserError(f"unknown method '{name}'{did_you_mean(name, tuple(REGISTRY))}: expected one of "
                    f"{', '.join(REGISTRY)}")
  cls, overrides = REGISTRY[name]
  check_fields(cls, hyperparameters, name, "unknown hyperparameters")
  return cls(**{**overrides, **coerce(cls, hyperparameters, name)})


def coerce(cls: type, values: dict, name: str) -> dict:
  """Checks hyperparameters against the method's field types (from JSON: a list becomes a tuple, an int a
  float, in a tuple too); a wrong type is a one-line error, not a TypeError inside jit. The values' ranges
  (finiteness included) are the fields' own (`hyperparameters.field`), checked when the method is built."""
  hints = typing.get_type_hints(cls)
  out = {}
  for k, v in values.items():
    t = hints[k]
    optional = typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)
    if optional:
      t = next(a for a in typing.get_args(t) if a is not type(None))
    item = typing.get_args(t)[0] if typing.get_origin(t) is tuple else None
    if v is None and optional:
      out[k] = v
    elif t is float and _is_number(v):
      out[k] = float(v)
    elif t in (int, bool, str) and type(v) is t:
      out[k] = v
    elif item is float and isinstance(v, (list, tuple)) and all(_is_number(x) for x in v):
      out[k] = tuple(float(x) for x in v)
    elif item is not None and isinstance(v, (list, tuple)) and all(type(x) is item for x in v):
      out[k] = tuple(v)
    elif dataclasses.is_dataclass(t) and isinstance(v, (dict, t)):
      out[k] = v
    else:
      want = getattr(t, "__name__", str(t))
      raise UserError(f"{name} {k}: expected {'None or ' if optional else ''}{want}, got {v!r}")
  return out


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


__all__ = ["AdaContrast", "AdaptState", "CFA", "CMF", "CoTTA", "DCT", "DDA", "DePTG", "DeYO", "DPAL", "DPCore",
           "EATA", "FOA", "MEMO", "Method", "PCSR", "Prepared", "REGISTRY", "REM", "ROID", "SAR", "SPA", "Source", "T3A",
           "Tent", "VCT", "ZeroSiam", "get", "load", "origin", "register"]
