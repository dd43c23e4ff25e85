#!/usr/bin/env bash
# The carried Triton cache (.triton_cache_parts/) of the GPU calls, sourced by gpu_call.sh and paper_scale_call.sh:
#   restore_triton_cache   unpack the carried parts into .triton_cache (xz parts if present, else gzip parts)
#   return_triton_cache    prune .triton_cache (prune_triton_cache.py) and write it to $OUT in gzip parts < 16 MB
# On the way back the call packs fast (gzip); `dev/triton_cache_parts.sh repack DIR` (here, between calls) turns the
# returned gzip parts of DIR into xz parts in .triton_cache_parts/: about a quarter of the bytes, so the cache stays
# within the carry limit beside the wheels. The GPU side unpacks xz with Python's lzma (no xz binary needed).

restore_triton_cache() {
  if compgen -G ".triton_cache_parts/tc.txz.part_*" >/dev/null; then
    cat .triton_cache_parts/tc.txz.part_* | python3 -c \
      'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(filter="data")'
  elif compgen -G ".triton_cache_parts/tc.tgz.part_*" >/dev/null; then
    cat .triton_cache_parts/tc.tgz.part_* | tar xzf -
  else
    return 0
  fi
  echo "restored Triton cache: $(du -sh .triton_cache | cut -f1)"
}

return_triton_cache() {
  mkdir -p .triton_cache
  python3 dev/prune_triton_cache.py .triton_cache
  tar czf - .triton_cache | split -b 15m - "$OUT/tc.tgz.part_"
}

if [ "${1:-}" = repack ]; then
  set -eu
  src=$2
  work=$(mktemp -d)
  cat "$src"/tc.tgz.part_* | tar xzf - -C "$work"
  mkdir -p .triton_cache_parts
  rm -f .triton_cache_parts/tc.*.part_*
  tar cf - -C "$work" .triton_cache | xz -T0 -9 | split -b 15m - .triton_cache_parts/tc.txz.part_
  rm -rf "$work"
  du -ch .triton_cache_parts/tc.txz.part_* | tail -1
fi
