# Sourced by scripts/main.sh and scripts/test.sh: the virtual environment with the core package, and the
# built-in benchmark's data. PCSR_VENV: where the environment lives (default .venv in the repository).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${PCSR_VENV:-.venv}

# Real Fashion-MNIST from Debian or Ubuntu (idx files under /usr/share/datasets), for the built-in benchmark.
FMNIST=/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz
if [ ! -f "$FMNIST" ]; then
  echo "== installing Debian's dataset-fashion-mnist (the built-in benchmark's images)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
    { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null; } || \
    { echo "could not install dataset-fashion-mnist with apt-get: install it, or pass --fashion-mnist-dir DIR" \
           "(the four idx files) to the main job" >&2; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating the virtual environment $VENV"
  python3 -m venv "$VENV" || { echo "python3 -m venv failed: install python3-venv (apt-get install python3-venv)" >&2; exit 1; }
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
. "$VENV/bin/activate"
