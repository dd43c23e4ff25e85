#!/bin/bash
# One recipe on both tiny models, side by side (one thread each): sweep.sh TAG '{mix}' '{train}'
# Results: TAG_{dn,gdn}.log (last line: JSON with bits/byte and probe acc, unpruned and pruned 75%).
cd "$(dirname "$0")/../../.."
for fam in dn:delta_net gdn:gated_deltanet; do
  .venv/bin/python docs/experiments/recall_mix/run.py "$1_${fam%%:*}" "${fam#*:}" "$2" "$3" \
    > "docs/experiments/recall_mix/$1_${fam%%:*}.log" 2>&1 &
done
wait
