#!/usr/bin/env bash
# Fetch what `benchmarks/offline_ptxas.py` needs to compile Mosaic GPU kernels for sm_90a on a host
# with no GPU: jax's CUDA plugin (its XLA compiler runs Mosaic's MLIR -> PTX pipeline and ptxas
# in a "deviceless" compile) and nvdisasm for the SASS. Everything lands in the git-ignored
# .offline_cuda/ (~200 MB); nothing is installed into .venv.
#   bash benchmarks/offline_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JAXVER=$($PY -c 'import jax; print(jax.__version__)')
mkdir -p .offline_cuda/wheels .offline_cuda/site
$PY -m pip download -q --no-deps -d .offline_cuda/wheels \
  "jax-cuda12-plugin==$JAXVER" "jax-cuda12-pjrt==$JAXVER" nvidia-cuda-nvdisasm
# ptxas: the host's own if it has one (CUDA 13.0 here gave the device's spill counts to the byte),
# else the one in NVIDIA's nvcc wheel.
if ! command -v ptxas >/dev/null; then
  $PY -m pip download -q --no-deps -d .offline_cuda/wheels nvidia-cuda-nvcc-cu12
fi
for w in .offline_cuda/wheels/*.whl; do
  $PY -m zipfile -e "$w" .offline_cuda/site
done
mkdir -p .offline_cuda/bin
for tool in nvdisasm ptxas; do
  found=$(find .offline_cuda/site -path "*/bin/$tool" -type f | head -1)
  if [ -n "$found" ]; then chmod +x "$found"; ln -sf "$PWD/$found" ".offline_cuda/bin/$tool"; fi
done
rm -rf .offline_cuda/wheels
echo "offline CUDA compile kit for jax $JAXVER in .offline_cuda/ ($(du -sh .offline_cuda | cut -f1))"
