#!/usr/bin/env bash
# Runs probe.py once per library and round, the libraries alternating within each round
# (README.md here; tools/lib_ab.sh):
#   ROUNDS=2 bash tools/sm90_split_probe/run.sh head=build/x/_vidattn_ops.so \
#       loadonly=OUT/loadonly/_vidattn_ops.so noloads=OUT/noloads/_vidattn_ops.so -- --margins 0,66
# Each library runs from a private copy of this tree's python/vidattn. Arguments after -- go
# to probe.py; --dense is passed to the first library's first round only.
set -uo pipefail
cd "$(dirname "$0")/../.."
libs=()
while (($#)) && [[ $1 != "--" ]]; do libs+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
args=() dense=()
for a in "$@"; do [[ $a == --dense ]] && dense=(--dense) || args+=("$a"); done
AB_FIRST_ARGS="${dense[*]}" AB_TIMEOUT=${PROBE_TIMEOUT:-180} exec bash tools/lib_ab.sh \
  tools/sm90_split_probe/probe.py "${libs[@]}" -- "${args[@]}"
