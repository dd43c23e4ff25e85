#!/usr/bin/env bash
# One call on a lent GPU machine of the paper-scale runs (configs/gpu_paper_scale.yaml, docs/paper_scale.md): install
# the carried wheels (dev/gpu_wheels.txt), restore the carried Triton cache, run the workflow itself on the given
# targets within a deadline, and return what docs/records/paper_scale_h200.md reads.
#
#   dev/paper_scale_call.sh DEADLINE_S TARGET ...
#
# Runs `python3 -m snakemake TARGET ... --cores all --resources gpu=1 --scheduler greedy --keep-going --rerun-incomplete
# --configfile configs/gpu_paper_scale.yaml` (greedy: PuLP is not carried). Results stay on the machine while it is warm, so a call
# right after this one continues the same DAG. Returns $OUT/run.tgz (snakemake's log, benchmarks/, logs/, every
# small file under results/, a listing of every file's size, nvidia-smi's memory and load once a second) and the
# pruned Triton cache in parts under 16 MB (.triton_cache_parts/ here, for the next call's carry).
#
# With PAIRED=1 two GPU jobs share the GPU (--resources gpu=2) except those whose time or memory is the measurement
# (rft, grad_scores, speed, speed_baseline ask for both slots), so loading, pruning and evaluation jobs overlap; their
# wall times are then not those of a job alone.
set -u
start=$SECONDS
deadline=$1
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton_cache PYTHONUNBUFFERED=1
source dev/triton_cache_parts.sh
[ -d .triton_cache ] || restore_triton_cache
mkdir -p "$OUT/run"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 1000 >"$OUT/run/gpu_timeline.csv" &
smi=$!
left=$((deadline - (SECONDS - start) - 45))
echo "snakemake on $* with ${left}s"
gpus=(--resources gpu=1)
if [ "${PAIRED:-0}" = 1 ]; then
  gpus=(--resources gpu=2 --set-resources rft:gpu=2 grad_scores:gpu=2 speed:gpu=2 speed_baseline:gpu=2)
fi
timeout "$left" python3 -m snakemake "$@" --cores all "${gpus[@]}" --scheduler greedy --keep-going --rerun-incomplete \
  --configfile configs/gpu_paper_scale.yaml >"$OUT/run/snakemake.log" 2>&1
echo "snakemake rc=$? after $((SECONDS - start))s"
kill "$smi"
grep -E "^(rule|localrule) |Finished jobid|Error in rule|Exiting|steps \(" "$OUT/run/snakemake.log" | tail -n 40
find results -type f -printf '%s\t%p\n' | sort -k2 >"$OUT/run/sizes.tsv"
find results -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.csv' -o -name '*.parquet' \) \
  -size -4M >"$OUT/run/small_files.txt"
tar czf "$OUT/run.tgz" -C "$OUT" run -C "$PWD" benchmarks logs -T "$OUT/run/small_files.txt" 2>/dev/null
rm -r "$OUT/run"
return_triton_cache
echo "returned: $(ls "$OUT" | tr '\n' ' ') after $((SECONDS - start))s"
