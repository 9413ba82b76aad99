"""Every method's hyperparameter ranges (`pcsr_jax.methods.hyperparameters.field`): each numeric or string field of every
registered method declares what it accepts, its defaults pass, and a value outside the declared range is refused
in one line by `methods.get` and by direct construction alike, before any work. Plus the cases that got through or
crashed before the rule was one."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from pcsr_jax import engine, methods
from pcsr_jax.errors import UserError
from pcsr_jax.methods import hyperparameters
from tiny import tiny_model


def bare_type(t):
  """``t`` without ``Optional``; a tuple's element type."""
  if typing.get_origin(t) is typing.Union:
    t = next(a for a in typing.get_args(t) if a is not type(None))
  return typing.get_args(t)[0] if typing.get_origin(t) is tuple else t


@pytest.mark.parametrize("name", list(methods.REGISTRY))
def test_every_numeric_or_string_field_declares_its_range_and_the_defaults_pass(name):
  cls, overrides = methods.REGISTRY[name]
  hints = typing.get_type_hints(cls)
  declared = {s.name for s in hyperparameters.specs(cls)}
  for f in dataclasses.fields(cls):
    if bare_type(hints[f.name]) in (int, float, str):
      assert f.name in declared, f"{name} {f.name}: declare its range with hyperparameters.field"
  methods.get(name)
  cls(**overrides)


def out_of_range(spec: hyperparameters.Spec) -> list:
  """Values outside what ``spec`` accepts: past each end of its range, non-finite, of the wrong kind or size."""
  if isinstance(spec.check, tuple):
    bad = ["no-such-choice"]
  else:
    bad = [math.nan, math.inf] if spec.kind == "float" else [1.5]
    if spec.check is not None:
      lo, hi, lo_open, hi_open = spec.bounds()
      step = 1 if spec.kind == "int" else 1e-3
      if lo > -math.inf:
        bad.append(lo if lo_open else lo - step)
      if hi < math.inf:
        bad.append(hi if hi_open else hi + step)
    bad = [int(v) if spec.kind == "int" and isinstance(v, float) and v.is_integer() else v for v in bad]
  if spec.is_tuple:
    n = spec.size or 1
    bad = [(v,) * n for v in bad] + ([(0.5,) * (spec.size - 1), (0.5,) * (spec.size + 1)] if spec.size else [])
  return bad


CASES = [(name, spec, value) for name, (cls, _) in methods.REGISTRY.items() for spec in hyperparameters.specs(cls)
         for value in out_of_range(spec)]


@pytest.mark.parametrize("name, spec, value", CASES, ids=[f"{n}-{s.name}-{v}" for n, s, v in CASES])
def test_a_value_outside_the_declared_range_is_one_line(name, spec, value):
  cls, overrides = methods.REGISTRY[name]
  with pytest.raises(UserError, match=rf"^{cls.name} {spec.name}: expected .+, got ") as e:
    cls(**{**overrides, spec.name: value})
  assert "\n" not in str(e.value)
  # From --method-args (JSON: a list for a tuple). A float for an int is refused there by its type, under the
  # registry's name ('eta' for EATA's variant).
  with pytest.raises(UserError, match=rf"^({cls.name}|{name}) {spec.name}: expected .+, got "):
    methods.get(name, **{spec.name: list(value) if spec.is_tuple else value})


@pytest.mark.parametrize("name, kw, match", [
    # Accepted and completed where siblings refused (issue 34, item 8).
    ("cotta", dict(std=[0.5, math.inf, 0.5]), r"^cotta std: expected 3 numbers > 0, got \(0.5, inf, 0.5\)$"),
    ("eta", dict(lr=-0.001), r"^eata lr: expected None or a number > 0, got -0.001$"),
    ("cfa", dict(lr=-0.001), r"^cfa lr: expected a number > 0, got -0.001$"),
    ("deyo", dict(lr=-0.001), r"^deyo lr: expected None or a number > 0, got -0.001$"),
    ("foa", dict(sigma0=-1.0), r"^foa sigma0: expected a number > 0, got -1.0$"),
    ("foa", dict(sigma0=0.0), r"^foa sigma0: expected a number > 0, got 0.0$"),  # was "lower its learning rate"
    ("cfa", dict(momentum=3.0), r"^cfa momentum: expected a number in \[0, 1\), got 3.0$"),
    # Tracebacks where one line was owed (item 7): empty or 2-channel normalisations of RGB augmentations.
    ("cotta", dict(mean=[], std=[]), r"^cotta mean: expected 3 finite numbers, got \(\)$"),
    ("memo", dict(mean=[], std=[]), r"^memo mean: expected 3 finite numbers, got \(\)$"),
    ("adacontrast", dict(mean=[], std=[]), r"^adacontrast mean: expected 3 finite numbers, got \(\)$"),
    ("cotta", dict(mean=[0.5, 0.5], std=[0.5, 0.5]), r"^cotta mean: expected 3 finite numbers, got \(0.5, 0.5\)$"),
    ("memo", dict(mean=[0.5, 0.5], std=[0.5, 0.5]), r"^memo mean: expected 3 finite numbers, got \(0.5, 0.5\)$"),
    ("adacontrast", dict(mean=[0.5, 0.5], std=[0.5, 0.5]), r"^adacontrast mean: expected 3 finite numbers"),
    # The rules that tie fields together, in every method that has them.
    ("spa", dict(mean=[0.5, 0.5]), r"^spa mean/std: expected one mean and one std per channel"),
    ("spa", dict(mean=[], std=[]), r"^spa mean/std: expected one mean and one std per channel"),
    ("roid", dict(momentum=0.0), r"^roid nesterov: expected momentum > 0 with Nesterov"),
    ("adacontrast", dict(momentum=0.0), r"^adacontrast nesterov: expected momentum > 0 with Nesterov"),
    ("pcsr", dict(config={"skip_blocks": [-1]}), r"^pcsr config skip_blocks: expected a tuple of integers >= 0"),
])
def test_named_cases(name, kw, match):
  with pytest.raises(UserError, match=match):
    methods.get(name, **kw)


def test_direct_construction_refuses_as_the_registry_does():
  with pytest.raises(UserError, match=r"^eata lr: expected None or a number > 0, got -1$"):
    methods.EATA(lr=-1)
  with pytest.raises(UserError, match=r"^t3a filter_k: expected an integer >= 1, got 2.0$"):
    methods.T3A(filter_k=2.0)
  assert dataclasses.replace(methods.EATA(), fisher_alpha=0.0).fisher_alpha == 0.0
  with pytest.raises(UserError, match="eata fisher_alpha"):
    dataclasses.replace(methods.EATA(), fisher_alpha=-1.0)


def test_valid_values_are_kept_as_given():
  """JSON's ints become floats (in a tuple too); values in range, at a closed end included, pass unchanged."""
  m = methods.get("cotta", std=[1, 1, 1], mean=[0, 0, 0], momentum=0, rst=1, mt=0.0, ap=1)
  assert m.std == (1.0, 1.0, 1.0) and m.mean == (0.0, 0.0, 0.0) and m.momentum == 0.0 and m.rst == 1.0
  assert methods.get("spa", lr_norm=0, freq_mask_ratio=0.0, noise_ratio=1.0).lr_norm == 0.0
  assert methods.get("pcsr", lr_dsn=0.0, lr_norm=None).lr_norm is None
  assert methods.get("eta", margin_factor=0.0).margin_factor == 0.0


def test_t3a_filter_k_past_what_a_support_store_holds_is_one_line():
  """filter_k 1e8 allocated a [C, 1e8, D] store (RESOURCE_EXHAUSTED); the bound names the largest for the model."""
  model, params = tiny_model()
  dim, classes = params["head"]["kernel"].shape
  most = methods.t3a.MAX_STORE_BYTES // (4 * classes * dim)
  with pytest.raises(UserError, match=rf"^t3a filter_k: expected at most {most} with {classes} classes of {dim} "
                                      r"features \(a support store of at most 2 GiB\), got 100000000$"):
    engine.Adapter(methods.get("t3a", filter_k=10**8), model, params, batch_size=4)
  assert most > 1000  # a tiny model's store holds far more than any K in use
