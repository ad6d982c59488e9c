# Session 48, last device time (~8 minutes on an H200): the bar table (run_s46_grid.sh) only
# if the card is an H200; on an H100 it stops at once (session 46 has the H100 table).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/run_s46_grid.sh
else
  nvidia-smi --query-gpu=name --format=csv,noheader | head -1
fi
