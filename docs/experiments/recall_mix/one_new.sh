#!/bin/bash
# One recipe on one new tiny model: one_new.sh TAG m2|q35 '{mix}' '{train}' [noprune] -> TAG_{m2|q35}.log
# (progress bars stripped; last line: JSON)
cd "$(dirname "$0")/../../.."
fam=mamba2; [ "$2" = q35 ] && fam=qwen3_5
.venv/bin/python docs/experiments/recall_mix/run_new.py "$1_$2" "$fam" "$3" "$4" $5 2>&1 \
  | tr '\r' '\n' | grep -v 'it/s\]$\|step/s\]$\|s/step\]$\|%|' > "docs/experiments/recall_mix/$1_$2.log"
