# Session 36, call 1 (shortened: ~650 s of device time went on refused starts): session 35's
# (Its one-slot compiled test was removed with the one-slot ring after this run: NOTES, session 36.)
# H = 64 defaults through the compiled reference tests, with the one-slot ring's compiled
# cases; the H = 256 forward with 128-key blocks in one K and one V slot against the default
# (64-key blocks, two slots), full and causal, cuDNN on the same inputs; the windowed H = 64
# forward over 4096 keys in the 128-key persistent forms (run_s36_call1.sh's last item).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 200 tests/pallas_attn/test_mosaic_masked_halves.py \
    tests/pallas_attn/test_mosaic_dq_registers.py \
    tests/pallas_attn/test_mosaic_dkdv_block_q.py \
    "tests/pallas_attn/test_mosaic_v_stages.py::test_one_slot_128_key_blocks_compiled"
export ONE_TIMEOUT_S=60
for causal in "" --causal; do
  one_fwd 4x4096x8x256 "$causal" ""
  one_fwd 4x4096x8x256 "$causal" "block_kv=128,num_stages=1"
done
one_fwd 4x4096x8x256 "" "block_kv=128,num_stages=1,persistent=True"
F128="block_kv=128,persistent=True,q_regs_cols=64"
breakdown wfwd 90 --rows 1x16384x32x64 --causal 1 --window 1024 \
    --variant "c128:$F128,dynamic_schedule=True" --variant "p128:$F128,dynamic_schedule=False"
