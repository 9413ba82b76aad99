"""User-facing errors: one line, exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, Iterable, NoReturn, Sequence


class UserError(Exception):
  """Bad input from the user (a file, key, flag or value). Printed as one line."""


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


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
  """Runs a CLI entry point, turning `UserError` into a one-line message and exit 2. First, on a CPU-only
  Linux host where ``PCSR_JAX_MALLOC`` asks for them, restarts the command under `pcsr_jax.malloc`'s glibc
  settings."""
  from pcsr_jax import malloc

  try:
    malloc.reexec()
    code = main(argv)
  except UserError as e:
    prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "pcsr_jax"
    sys.stdout.flush()
    sys.stderr.flush()
    # Only this line: a failed orbax/tensorstore read leaves callbacks in other threads that print tracebacks
    # as the process winds down. Point stderr at /dev/null first, write the line to a copy, exit at once.
    line = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(line, f"{prog}: error: {e}\n".encode())
    os._exit(2)
  except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    sys.exit(130)
  sys.exit(code or 0)
