#!/usr/bin/env bash
# A/B of op libraries on the whole VSA forward: tools/profile_vsa.py (kernel time per forward
# and the largest kernels) once per library and round, alternating (tools/lib_ab.sh).
#   ROUNDS=2 bash tools/vsa_lib_ab.sh new=build/x/_vidattn_ops.so \
#       old=/tmp/old/_vidattn_ops.so@/tmp/old-tree/python -- --grid 21x45x80 --heads 40
# LIB@DIR: the Python package (DIR/vidattn) that goes with the library (lib_ab.sh says why).
# Arguments after -- go to profile_vsa.py (default: Wan 480p, --iters 10).
set -uo pipefail
cd "$(dirname "$0")/.."
libs=()
while (($#)) && [[ $1 != "--" ]]; do libs+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
(($#)) || set -- --iters 10
AB_FILTER="^== vsa|^ " AB_LINES=4 exec bash tools/lib_ab.sh tools/profile_vsa.py \
  "${libs[@]}" -- "$@"
