# Session 19, device call 4: groups sharing one wgmma scope (MosaicConfig.acc_columns) in the
# stream-K kernel (new) and more of them at 32-64 rows; compiled forms tests first.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 120 python3 -m pytest -q -n 8 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mosaic_forms.py 2>&1 | tail -3 \
    | tee "$out/forms_tests.txt"
probe() {  # name, variants, shapes
  mkdir -p "$out/$1"
  timeout -k 5 150 python3 benchmarks/w4a16_probe.py --out "$out/$1" --budget-s 130 \
      --variants "$2" --shapes "$3" 2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err" | tail -12
}
probe m16_32 base,scope1,acc128,base_again 16x8192x28672,32x8192x28672
probe m64 base,acc128,acc256,base_again 64x8192x28672,64x28672x8192
