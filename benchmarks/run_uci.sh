#!/usr/bin/env bash
# Run a method on UCI data sets split by split, interleaving data sets so that every data set
# gains splits at the same pace; resumable (splits already in the output are skipped).
#
#   benchmarks/run_uci.sh kivi benchmarks/results/uci_kivi_part1.json wine yacht boston
#   benchmarks/run_uci.sh kivi benchmarks/results/uci_kivi_part2.json energy concrete
#   FIRST_SPLIT=5 benchmarks/run_uci.sh fsvgd OUT2 kin8nm naval   # splits 5.. in a 2nd file
#   UCI_ARGS="--set clip_norm=10" benchmarks/run_uci.sh kivi OUT yacht  # extra runner options
#   python benchmarks/uci_report.py benchmarks/results/uci_kivi_part*.json --paper kivi \
#       --title "KIVI (ImplicitGuide + KernelRatioELBO)" --out benchmarks/results/uci.md
set -euo pipefail
method=$1
out=$2
shift 2
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for k in $(seq "${FIRST_SPLIT:-0}" 19); do
  for d in "$@"; do
    # shellcheck disable=SC2086  # UCI_ARGS is a list of options
    python benchmarks/uci.py --method "$method" --datasets "$d" --splits "$k" --resume \
      --quiet --out "$out" ${UCI_ARGS:-}
  done
done
