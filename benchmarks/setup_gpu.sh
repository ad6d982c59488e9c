# Prepare the GPU machine's python3 for the benchmarks. Source it from the repository root:
#
#   source benchmarks/setup_gpu.sh
#
# Installs the carried wheels in .whl/ (tokamax and the dependencies the machine lacks) into
# /tmp/site and puts /tmp/site, the xprof stub (.whl/stubs) and the repository root on PYTHONPATH.
# A missing .whl/ is not fatal: our backends, cuDNN and XLA still run, tokamax rows record an error.
# Uses `return`, never `exit`, so that a failure cannot end the shell that sourced it.

_repo="$(pwd)"
_site="${BENCH_SITE:-/tmp/site}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

if ls "$_repo"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$_site" "$_repo"/.whl/*.whl \
    || echo "setup_gpu: WARNING: wheel install failed; tokamax will be missing" >&2
  # pydantic_core needs typing_extensions >= 4.14 (Sentinel); carry a newer one only if needed.
  if ! python3 -c "from typing_extensions import Sentinel" >/dev/null 2>&1; then
    echo "setup_gpu: typing_extensions too old, installing the fallback wheel" >&2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$_site" "$_repo"/.whl/fallback/*.whl \
      || echo "setup_gpu: WARNING: typing_extensions fallback install failed" >&2
  fi
else
  echo "setup_gpu: WARNING: no wheels in $_repo/.whl (was .whl carried?); tokamax will be missing" >&2
fi

export PYTHONPATH="$_site:$_repo/.whl/stubs:$_repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

python3 - <<'EOF' || true
import importlib
from importlib import metadata
for name, dist in (("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"),
                   ("typing_extensions", "typing_extensions"), ("pydantic", "pydantic"),
                   ("tokamax", "tokamax")):
  try:
    module = importlib.import_module(name)
    print(f"setup_gpu: {name} {metadata.version(dist)} from {module.__file__}")
  except Exception as e:  # report, never fail: the benchmark records per-backend errors
    print(f"setup_gpu: {name} FAILED to import: {type(e).__name__}: {e}")
EOF
unset _repo _site
