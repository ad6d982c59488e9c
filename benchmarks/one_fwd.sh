# Sourced by the forward-variant call scripts: ``one ARGS`` runs one mosaic_one.py config (cuDNN
# in the same process) under a timeout of ${limit:-60} s, appending its result to $out/fwd.jsonl
# and its output to $out/fwd.log; a config that fails or hangs leaves an "rc=..." line instead.
one() {
  echo "=== $*" >> "$out/fwd.log"
  timeout -k 5 "${limit:-60}" python3 benchmarks/mosaic_one.py "$@" --cudnn --out "$out/fwd.jsonl" \
      >> "$out/fwd.log" 2>&1 || echo "rc=$? $*" | tee -a "$out/fwd.log"
}
