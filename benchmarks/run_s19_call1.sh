# Session 19, device call 1: MosaicConfig.out_registers (partials stored from registers, no
# output tile in SMEM) compiled, then the wider CTAs it allows at M = 64 (and 32).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 8 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mosaic_forms.py 2>&1 | tail -4 \
    | tee "$out/forms_tests.txt"
probe() {  # name, variants, shapes
  mkdir -p "$out/$1"
  timeout -k 5 170 python3 benchmarks/w4a16_probe.py --out "$out/$1" --budget-s 150 \
      --variants "$2" --shapes "$3" 2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -12
}
probe m64_stream base,oreg,wide_oreg,bk256_n128_oreg,base_again 64x8192x28672
probe m64_grid base,oreg,n256_oreg,s4_oreg,base_again 64x28672x8192,64x8192x8192
probe m32 base,n256_s2_oreg,base_again 32x8192x28672
