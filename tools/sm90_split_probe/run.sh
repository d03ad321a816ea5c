#!/usr/bin/env bash
# Runs probe.py once per library and round, the libraries alternating within each round
# (README.md here):
#   ROUNDS=2 bash tools/sm90_split_probe/run.sh head=build/x/_vidattn_ops.so \
#       loadonly=OUT/loadonly/_vidattn_ops.so noloads=OUT/noloads/_vidattn_ops.so -- --margins 0,66
# Each library runs from a private copy of this tree's python/vidattn. Arguments after -- go
# to probe.py; --dense is passed to the first library's first round only.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
names=()
while (($#)) && [[ $1 != "--" ]]; do
  name=${1%%=*}; lib=${1#*=}
  if [[ $name == "$1" || ! -f $lib ]]; then
    echo "sm90_split_probe: expected NAME=LIB.so with an existing library, got '$1'" >&2
    exit 2
  fi
  shift
  mkdir -p "$WORK/$name"
  cp -r python/vidattn "$WORK/$name/"
  rm -f "$WORK/$name"/vidattn/*.so
  cp "$lib" "$WORK/$name/vidattn/_vidattn_ops.so"
  names+=("$name")
done
[[ ${1:-} == "--" ]] && shift
args=() dense=0
for a in "$@"; do [[ $a == --dense ]] && dense=1 || args+=("$a"); done
((${#names[@]})) || { echo "sm90_split_probe: no libraries given" >&2; exit 2; }
for ((r = 1; r <= ROUNDS; ++r)); do
  for name in "${names[@]}"; do
    extra=()
    ((dense && r == 1)) && [[ $name == "${names[0]}" ]] && extra=(--dense)
    echo "== $name, round $r"
    PYTHONPATH="$WORK/$name" timeout "${PROBE_TIMEOUT:-180}" python3 \
      tools/sm90_split_probe/probe.py "${args[@]}" "${extra[@]}"
  done
done
