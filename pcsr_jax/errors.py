"""User-facing errors: one line, exit code 2, never a traceback.

The bottom layer: imports nothing of pcsr_jax, so every module may raise `UserError`. `pcsr_jax.cli.run_cli`
prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Iterable, NoReturn


class UserError(Exception):
  """Bad input from the user (a file, key, flag or value). Printed as one line."""


def error_line(message: str) -> str:
  """The command's one line for ``message``: ``<command>: error: <message>``, as argparse words its own."""
  prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "pcsr_jax"
  return f"{prog}: error: {message}\n"


def check_fields(cls: type, given: Iterable[str], what: str, noun: str = "unknown fields") -> None:
  """One-line error if ``given`` (a config dict's keys) names anything that is not a field of dataclass ``cls``."""
  unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
  if unknown:
    raise UserError(f"{what}: {noun} {unknown}")


class ArgumentParser(argparse.ArgumentParser):
  """argparse that reports a bad flag in one line (no usage dump) with exit code 2."""

  def error(self, message: str) -> NoReturn:
    sys.stderr.write(f"{self.prog}: error: {message}\n")
    sys.exit(2)
