#!/usr/bin/env bash
# LIVI on the paper's five UCI sets with both bounds, split by split, interleaving data sets
# and bounds so that all gain splits at the same pace; resumable.
#
#   benchmarks/run_uci_livi.sh benchmarks/results/uci_livi.json benchmarks/results/uci_livi_svd.json
set -euo pipefail
out_det=$1
out_svd=$2
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for k in $(seq 0 19); do
  for d in boston concrete energy kin8nm naval; do
    python benchmarks/uci.py --method livi --datasets "$d" --splits "$k" --resume --quiet \
      --out "$out_det"
    python benchmarks/uci.py --method livi_svd --datasets "$d" --splits "$k" --resume --quiet \
      --out "$out_svd"
  done
done
