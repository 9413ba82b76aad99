#!/usr/bin/env bash
# The test suite on a fresh machine: the virtual environment (.venv) with the core package, the built-in data,
# torch, torchvision and timm (the PyTorch references and timm parity tests), Ray (--executor ray's tests on a
# local cluster bound to 127.0.0.1), then pytest on every core.
# PCSR_TORCH: the torch packages to install (default the releases CI uses). PyPI's torch is the CUDA build,
# about 5.5 GB with its NVIDIA wheels, also on a machine without a GPU; PCSR_TORCH_INDEX=<index URL> takes
# torch from another index (e.g. PyTorch's CPU-only one). Extra arguments go to pytest.
. "$(dirname "$0")/env.sh"
TORCH=${PCSR_TORCH:-"torch==2.14.1 torchvision==0.29.1"}
python -m pip install -q ${PCSR_TORCH_INDEX:+--index-url "$PCSR_TORCH_INDEX"} $TORCH
python -m pip install -q -e ".[convert,test,ray]"
export PCSR_REQUIRE_TORCH=1  # a torch that does not import fails the run instead of skipping its tests
set +e
python -m pytest -q -n auto --dist loadfile "$@"
rc=$?
set -e
# pytest exits 5 when it collects no test: a failure, not a pass.
if [ "$rc" -eq 5 ]; then echo "scripts/test.sh: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
