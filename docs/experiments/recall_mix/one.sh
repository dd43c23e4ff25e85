#!/bin/bash
# One recipe on one tiny model: one.sh TAG dn|gdn '{mix}' '{train}'  -> TAG_{dn|gdn}.log (last line: JSON)
cd "$(dirname "$0")/../../.."
fam=delta_net; [ "$2" = gdn ] && fam=gated_deltanet
.venv/bin/python docs/experiments/recall_mix/run.py "$1_$2" "$fam" "$3" "$4" > "docs/experiments/recall_mix/$1_$2.log" 2>&1
