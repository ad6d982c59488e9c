#!/usr/bin/env bash
# Rebuild the git-ignored .whl/ that the GPU machine (no internet) installs tokamax from
# (`setup_gpu.sh`): run on a machine with pip access, from the repository root, then carry
# ".whl" in the device call. Versions as measured since session 30 (benchmarks/README.md).
set -euo pipefail
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3.12
get() {  # dest, requirement
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$1" "$2"
}
mkdir -p .whl/fallback .whl/stubs/xprof/cli
for req in tokamax==0.0.17 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 tensorboardx==2.6.5 \
           pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 \
           typing-inspection==0.4.2; do
  get .whl "$req"
done
get .whl/fallback typing_extensions==4.15.0   # installed only where Sentinel is missing
: > .whl/stubs/xprof/__init__.py
: > .whl/stubs/xprof/cli/__init__.py
cat > .whl/stubs/xprof/cli/tools.py <<'PY'
"""Stub for tokamax's `from xprof.cli.tools import get_kernel_stats_tool` (unused here)."""


def get_kernel_stats_tool(*args, **kwargs):
  raise NotImplementedError("xprof is not installed on this machine (stub)")
PY
ls .whl .whl/fallback
du -sh .whl
