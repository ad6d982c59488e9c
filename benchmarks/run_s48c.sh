# Session 48: on an H200 the bar table first (run_s46_grid.sh, ~8 minutes); on an H100 the
# joint-launch pricing (run_s48b.sh, ~5 minutes).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/run_s46_grid.sh
else
  bash benchmarks/run_s48b.sh
fi
