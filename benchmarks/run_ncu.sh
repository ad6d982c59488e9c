#!/usr/bin/env bash
# Nsight Compute profiles (stall reasons, issue slots, memory, per-SASS-line samples) of the W4A16
# decode kernel and the attention backward kernels on the GPU machine:
#   bash benchmarks/run_ncu.sh [w4_m1 w4_m16 w4_m64 w4_late_m1 w4_late_m16 attn_dkdv attn_dq
#                               attn_dkdv_pt attn_dkdv_240 attn_dkdv_pt240 attn_fwd_h64 attn_fwd_h256
#                               attn_fwd_h128 attn_fp8 attn_fp8_preg cudnn_bwd cudnn_fwd
#                               cudnn_fwd_h256 attn_dkdv_16k attn_dkdv_16k_causal
#                               attn_dkdv_16k_232 attn_dkdv_232 attn_dkdv_pers]
OUT="${OUT:-/tmp/ncu_out}"; mkdir -p "$OUT"; cd "$(dirname "$0")/.." || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1); echo "ncu=$NCU"; $NCU --version | tail -1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats"
prof() { name=$1; shift; rx=$1; shift; timeout -k 5 220 $NCU --clock-control none --kernel-name regex:$rx --launch-skip 2 --launch-count 1 $S --import-source no -f --export $OUT/$name python3 benchmarks/ncu_target.py "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; tail -3 $OUT/$name.log; $NCU --import $OUT/$name.ncu-rep --page details > $OUT/$name.txt 2>&1; $NCU --import $OUT/$name.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/$name.sass.csv.gz; grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|One or More Eligible|Block Size|Grid Size|Shared Memory Per Block|Shared Memory Configuration Size|Block Limit|L1/TEX Hit|Max Bandwidth" $OUT/$name.txt | head -40; }
# Profiles by name (default: all four); the device returns at most 8 files, so keep <= 4.
for p in "${@:-w4_m1 w4_m16 attn_dkdv attn_dq}"; do
  case "$p" in
    w4_m1) prof w4_m1 w4a16 w4a16 --m 1 ;;
    w4_m16) prof w4_m16 w4a16 w4a16 --m 16 ;;
    w4_m64) prof w4_m64 w4a16 w4a16 --m 64 ;;
    w4_late_m1) prof w4_late_m1 w4a16 w4a16 --m 1 --late-zero ;;
    w4_late_m16) prof w4_late_m16 w4a16 w4a16 --m 16 --late-zero ;;
    attn_dkdv) prof attn_dkdv flash_attention_dkdv attention ;;
    attn_dkdv_16k) prof attn_dkdv_16k flash_attention_dkdv attention --b 1 --t 16384 ;;
    attn_dkdv_16k_causal) prof attn_dkdv_16k_causal flash_attention_dkdv attention --b 1 \
        --t 16384 --causal ;;
    attn_dkdv_16k_232) prof attn_dkdv_16k_232 flash_attention_dkdv attention --b 1 --t 16384 \
        --fields bwd_registers=232 ;;
    attn_dkdv_232) prof attn_dkdv_232 flash_attention_dkdv attention --fields bwd_registers=232 ;;
    attn_dkdv_pers) prof attn_dkdv_pers flash_attention_dkdv attention \
        --fields bwd_persistent=True ;;
    attn_dq) prof attn_dq flash_attention_dq attention ;;
    attn_fwd_h64) prof attn_fwd_h64 flash_attention_fwd attention --heads 32 --head-dim 64 ;;
    attn_fwd_h256) prof attn_fwd_h256 flash_attention_fwd attention --heads 8 --head-dim 256 ;;
    attn_fwd_h128) prof attn_fwd_h128 flash_attention_fwd attention ;;
    attn_fp8) prof attn_fp8 flash_attention_fwd attention_fp8 ;;
    cudnn_bwd) prof cudnn_bwd flash_bprop attention --implementation cudnn ;;
    cudnn_fwd) prof cudnn_fwd flash_fprop attention --implementation cudnn ;;
    cudnn_fwd_h256) prof cudnn_fwd_h256 flash_fprop attention --implementation cudnn \
        --heads 8 --head-dim 256 ;;
    attn_fp8_preg) prof attn_fp8_preg flash_attention_fwd attention_fp8 \
        --fields fp8_p_registers=True ;;
    attn_dkdv_pt) prof attn_dkdv_pt flash_attention_dkdv attention --fields bwd_pt_smem=True ;;
    attn_dkdv_240) prof attn_dkdv_240 flash_attention_dkdv attention --fields bwd_registers=240 ;;
    attn_dkdv_pt240) prof attn_dkdv_pt240 flash_attention_dkdv attention \
        --fields bwd_pt_smem=True,bwd_registers=240 ;;
    *) echo "unknown profile $p" ;;
  esac
done
rm -f $OUT/*.ncu-rep $OUT/*.log
ls -la $OUT
