#!/usr/bin/env bash
# One call on a lent GPU machine (see dev/README.md, docs/speed.md): install the carried wheels, restore the carried Triton
# cache (compiled kernels and fla's autotuning results), run named jobs one after another within a deadline, and
# return the Triton cache (pruned to metadata and binaries by prune_triton_cache.py) in parts under 16 MB so the next
# call (often on a fresh machine) skips the autotuning.
#
#   dev/gpu_call.sh DEADLINE_S 'name:command' ['name:command' ...]
#
# Each job's output goes to <name>.log, returned in $OUT/logs.tgz (at most 8 files come back); a job gets what is
# left of the deadline less 30 s for the cache. GPU_CALL_KEEP names files or folders of the repository (space
# separated) copied to $OUT after the jobs, also when the deadline killed one: a document that a later call on the
# same warm machine continues (`python -m statereduce.speed.generate DOC --resume`) stays where it is and comes back.
set -u
start=$SECONDS
deadline=$1
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton_cache
source dev/triton_cache_parts.sh
restore_triton_cache
for job in "$@"; do
  name=${job%%:*}
  cmd=${job#*:}
  left=$((deadline - (SECONDS - start) - 30))
  if [ "$left" -lt 20 ]; then echo "=== $name skipped: ${left}s left"; continue; fi
  echo "=== $name start $(date +%T), ${left}s left"
  timeout "$left" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  echo "=== $name rc=$? end $(date +%T)"
  grep -v Warning "$OUT/$name.log" | tail -4
done
for keep in ${GPU_CALL_KEEP:-}; do
  [ -e "$keep" ] && cp -r "$keep" "$OUT/" || echo "=== GPU_CALL_KEEP: $keep not found"
done
return_triton_cache
# at most 8 files come back: the logs travel as one archive
(cd "$OUT" && compgen -G "*.log" >/dev/null && tar czf logs.tgz ./*.log && rm ./*.log)
echo "Triton cache $(du -sh .triton_cache | cut -f1); returned: $(ls "$OUT" | tr '\n' ' ')"
