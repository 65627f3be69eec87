#!/usr/bin/env bash
# Regenerate every UCI table in benchmarks/results/*.md from the JSON files the runs wrote.
# A data set whose splits are spread over several files (parallel runs) gets one row.
# Only the marked sections change (see benchmarks/uci_report.py --section); the prose
# around them is written by hand and must be checked against the new numbers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R=benchmarks/results
# result files not written yet are left out (a table of none says so); a table whose splits
# ran at several commits (or before commits were recorded) needs --mixed-commits and says so
report() { python benchmarks/uci_report.py --missing-ok "$@"; }

report $R/uci_kivi_gamma_precision.json $R/uci_kivi_gamma_precision_part2.json --paper kivi \
  --mixed-commits \
  --title "KIVI (ImplicitGuide + KernelRatioELBO, the paper's settings and explicit Gamma precision)" \
  --out $R/uci.md --section kivi
report $R/uci_kivi_part1.json $R/uci_kivi_part2.json --paper kivi \
  --title "KIVI with an implicit q for the noise precision (earlier runs)" \
  --out $R/uci.md --section kivi_implicit_precision
report $R/uci_fsvgd.json $R/uci_fsvgd_large.json $R/uci_fsvgd_large_part2.json --paper fsvgd \
  --title "f-SVGD (FunctionSpaceSVGD), f-POVI UCI settings" \
  --out $R/uci_fsvgd.md --section fsvgd
report $R/uci_fsvgd_wsvgd.json $R/uci_fsvgd_wsvgd_large.json $R/uci_fsvgd_wsvgd_large_part2.json \
  --paper wsvgd --mixed-commits \
  --title "weight-space SVGD (WeightSpaceSVGD), same model and settings" \
  --out $R/uci_fsvgd.md --section wsvgd
report $R/uci_livi.json $R/uci_livi_part2.json --paper livi \
  --title "LIVI, bound L' (log-determinant, eq. 15)" --out $R/livi.md --section livi
report $R/uci_livi_svd.json $R/uci_livi_svd_part2.json --paper livi_svd \
  --title "LIVI, bound L'' (smallest singular value, eqs. 17-18)" \
  --out $R/livi.md --section livi_svd
report $R/uci_livi_600ep.json --paper livi \
  --title "LIVI, bound L', 600 / 100 epochs (under-trained, kept for the record)" \
  --out $R/livi.md --section livi_600ep
report $R/uci_livi_svd_600ep.json --paper livi_svd \
  --title "LIVI, bound L'', 600 / 100 epochs (under-trained, kept for the record)" \
  --out $R/livi.md --section livi_svd_600ep
report $R/uci_kivi_adaptive_contrast.json --paper kivi \
  --title "KIVI with adaptive contrast and an implicit precision q (adaptive_contrast=\"diag\")" \
  --out $R/uci.md --section kivi_adaptive_contrast
report $R/uci_kivi_clipped.json --paper kivi \
  --title "KIVI on yacht with gradient clipping (ClippedAdam, clip_norm=10: each gradient element clamped to +-10; not the paper's optimiser)" \
  --out $R/uci.md --section kivi_clipped
