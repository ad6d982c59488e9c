#!/usr/bin/env bash
# Run test files compiled on the GPU machine, one pytest per file, each under its own timeout,
# with a JUnit XML per file in $OUT so that a timeout still leaves the names of what ran.
#
#   bash benchmarks/run_gpu_tests.sh [-m MARKEXPR] [-k KEYWORDS] FILE...
#                                                             (env: WORKERS, FILE_TIMEOUT_S)
#
# Prints one summary line per file (passed/failed/errors/skipped from the XML) at the end.
set -u
OUT="${OUT:-/tmp/gpu_tests_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mark="not gpu"
keyword=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) mark="$2"; shift 2 ;;
    -k) keyword=(-k "$2"); shift 2 ;;
    *) break ;;
  esac
done
for f in "$@"; do
  name="$(basename "$f" .py)"
  echo "=== $f  (-m \"$mark\", $(date +%T))"
  timeout -k 5 "${FILE_TIMEOUT_S:-300}" python3 -m pytest -v --maxfail=30 -p no:cacheprovider \
      -n "${WORKERS:-12}" -m "$mark" ${keyword[@]+"${keyword[@]}"} "$f" --junitxml="$OUT/$name.xml" -rfE 2>&1 \
      | grep --line-buffered -v -i "warn" | tee "$OUT/$name.log"
done
python3 - "$OUT" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
for path in sorted(glob.glob(sys.argv[1] + "/*.xml")):
  suite = ET.parse(path).getroot()
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  a = suite.attrib
  print(f"{path.split('/')[-1]}: tests={a['tests']} failures={a['failures']} errors={a['errors']} "
        f"skipped={a['skipped']} time={a['time']}")
  for case in suite.iter("testcase"):
    for bad in list(case.findall("failure")) + list(case.findall("error")):
      print("   FAIL", case.attrib.get("classname"), case.attrib.get("name"),
            (bad.attrib.get("message") or "")[:300].replace("\n", " "))
PY
