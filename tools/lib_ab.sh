#!/usr/bin/env bash
# A/B of op libraries on one Python script: the script once per library and round, the
# libraries alternating within each round so that clock and thermal drift reach all alike.
#   ROUNDS=2 bash tools/lib_ab.sh SCRIPT new=build/x/_vidattn_ops.so \
#       old=/tmp/old/_vidattn_ops.so@/tmp/old-tree/python -- SCRIPT_ARGS
# Each library runs with its own Python package (LIB@DIR: DIR holds vidattn/; default this
# tree's python/), copied to a private folder: a library built from another commit may lack
# an op the newer Python calls, and the tree's own python/vidattn is never overwritten.
# Environment: ROUNDS (2); AB_TIMEOUT (120 s per run); AB_FIRST_ARGS (more arguments for the
# first library's first round only); AB_FILTER and AB_LINES (keep the output lines matching
# the grep -E pattern, at most AB_LINES of them; default everything).
# Used by tools/vsa_lib_ab.sh and tools/sm90_split_probe/run.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
script=${1:?SCRIPT}
shift
[[ -f $script ]] || { echo "lib_ab: no script $script" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
names=()
while (($#)) && [[ $1 != "--" ]]; do
  spec=$1; shift
  name=${spec%%=*}; rest=${spec#*=}
  lib=${rest%%@*}; pydir=$(pwd)/python
  [[ $rest == *@* ]] && pydir=${rest#*@}
  if [[ $name == "$spec" || ! -f $lib || ! -d $pydir/vidattn ]]; then
    echo "lib_ab: expected NAME=LIB.so[@PYTHON_DIR] with an existing library and" \
      "DIR/vidattn, got '$spec'" >&2
    exit 2
  fi
  mkdir -p "$WORK/$name"
  cp -r "$pydir/vidattn" "$WORK/$name/"
  rm -f "$WORK/$name"/vidattn/*.so
  cp "$lib" "$WORK/$name/vidattn/_vidattn_ops.so"
  names+=("$name")
done
[[ ${1:-} == "--" ]] && shift
((${#names[@]})) || { echo "lib_ab: no libraries given" >&2; exit 2; }
read -r -a first_args <<<"${AB_FIRST_ARGS:-}"
for ((r = 1; r <= ROUNDS; ++r)); do
  for name in "${names[@]}"; do
    extra=()
    ((r == 1)) && [[ $name == "${names[0]}" ]] && extra=("${first_args[@]}")
    echo "== $name, round $r"
    PYTHONPATH="$WORK/$name" timeout "${AB_TIMEOUT:-120}" python3 "$script" "$@" \
      "${extra[@]}" 2>&1 | grep -E "${AB_FILTER:-}" | head -n "${AB_LINES:--0}" ||
      echo "$name round $r failed"
  done
done
