#!/usr/bin/env bash
# LIVI on UCI with both bounds, split by split, interleaving data sets and bounds so that all
# gain splits at the same pace; resumable. Data sets: the paper's five unless listed.
#
#   benchmarks/run_uci_livi.sh benchmarks/results/uci_livi.json benchmarks/results/uci_livi_svd.json
#   benchmarks/run_uci_livi.sh OUT_DET OUT_SVD boston concrete energy
#   FIRST_SPLIT=10 benchmarks/run_uci_livi.sh OUT_DET2 OUT_SVD2 ...   # splits 10.. in 2nd files
set -euo pipefail
out_det=$1
out_svd=$2
shift 2
datasets=("$@")
if [ ${#datasets[@]} -eq 0 ]; then
  datasets=(boston concrete energy kin8nm naval)
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for k in $(seq "${FIRST_SPLIT:-0}" 19); do
  for d in "${datasets[@]}"; do
    python benchmarks/uci.py --method livi --datasets "$d" --splits "$k" --resume --quiet \
      --out "$out_det"
    python benchmarks/uci.py --method livi_svd --datasets "$d" --splits "$k" --resume --quiet \
      --out "$out_svd"
  done
done
