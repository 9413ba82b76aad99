"""Running a command: `pcsr_jax.malloc`'s restart first, then the command, its `UserError` as one line, exit 2.

The layers: `pcsr_jax.errors` (what bad input raises, and the argparse that reports a bad flag in one line)
imports nothing of pcsr_jax; `pcsr_jax.malloc` raises its `UserError`; this module, the top, uses both. Every
command (``experiments/*.py``, ``convert_weights.py``, ``benchmarks/*``) ends in ``run_cli(main, sys.argv[1:])``.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn, Sequence

from pcsr_jax import malloc
from pcsr_jax.errors import UserError


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> NoReturn:
  """Runs a CLI entry point, turning `UserError` into a one-line message and exit 2. First, on a CPU-only
  Linux host where ``PCSR_JAX_MALLOC`` asks for them, restarts the command under `pcsr_jax.malloc`'s glibc
  settings."""
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
