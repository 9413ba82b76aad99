"""Running a command: `pcsr_jax.malloc`'s restart first, then the command, its `UserError` as one line, exit 2;
Ctrl-C and SIGTERM as ``interrupted``, exit 130.

The layers: `pcsr_jax.errors` (what bad input raises, and the argparse that reports a bad flag in one line)
imports nothing of pcsr_jax; `pcsr_jax.malloc` raises its `UserError`; this module, the top, uses both. Every
command (``experiments/*.py``, ``convert_weights.py``, ``benchmarks/*``) ends in ``run_cli(main, sys.argv[1:])``;
a command's own file names its entry point as ``"module:function"``, imported after the restart: the file then
imports only this module (the standard library), and a Python without the project's packages (``python3``
outside ``.venv``) gets one line saying how to set up instead of a traceback.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import Callable, NoReturn, Sequence, Union

from pcsr_jax import malloc
from pcsr_jax.errors import UserError, error_line


# Missing modules that come with an extra, not with the core install.
EXTRAS = {"torch": "convert", "torchvision": "convert", "timm": "convert", "cma": "convert", "pytest": "test"}


def setup_hint(module: str) -> str:
  """The line for a Python that lacks ``module``: which Python it is, and how to get the project's."""
  extra = EXTRAS.get(module)
  how = (f"install the {extra} extra (`python -m pip install -e '.[{extra}]'` in the project's venv)" if extra else
         "activate the project's environment first (`. .venv/bin/activate`; `bash scripts/main.sh` makes it), or "
         "run the main job as `bash scripts/main.sh ARGS`")
  return f"the Python module '{module}' is not installed for {sys.executable}: {how}"


def run_cli(main: Union[str, Callable[[Sequence[str] | None], int | None]],
            argv: Sequence[str] | None = None) -> NoReturn:
  """Runs a CLI entry point (a function, or ``"module:function"`` imported here), turning `UserError` and a
  missing third-party module into a one-line message and exit 2. First, on a CPU-only Linux host where
  ``PCSR_JAX_MALLOC`` asks for them, restarts the command under `pcsr_jax.malloc`'s allocator settings."""
  try:
    malloc.reexec()
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop: as Ctrl-C (the run loop has its own handler)
    if isinstance(main, str):
      module, _, attr = main.partition(":")
      main = getattr(importlib.import_module(module), attr)
    code = main(argv)
  except UserError as e:
    _fail(str(e))
  except ModuleNotFoundError as e:
    if not e.name or e.name.split(".")[0] == "pcsr_jax":
      raise
    _fail(setup_hint(e.name.split(".")[0]))
  except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    sys.exit(130)
  sys.exit(code or 0)


def _interrupt(signum: int, frame) -> None:
  """SIGTERM outside a run's loop (building a cache, writing the results): stops the command as Ctrl-C does,
  with its one line and exit 130, its ``finally`` blocks run (no half-written temporary file left behind), where
  Python's default would end it silently."""
  raise KeyboardInterrupt


def _fail(message: str) -> NoReturn:
  """``<command>: error: <message>`` on stderr, exit 2, nothing else."""
  sys.stdout.flush()
  sys.stderr.flush()
  # Only this line: a failed orbax/tensorstore read leaves callbacks in other threads that print tracebacks
  # as the process winds down. Point stderr at /dev/null first, write the line to a copy, exit at once.
  line = os.dup(2)
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  os.write(line, error_line(message).encode())
  os._exit(2)
