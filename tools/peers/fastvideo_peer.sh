#!/usr/bin/env bash
# Puts the Python package of fastvideo-kernel (FastVideo's attention kernels, a peer of the
# bench's sparse cases) into DEST without building anything: its Triton kernels (block-sparse
# forward/backward, the whole VSA op) run without the package's compiled extension. Then
#   PYTHONPATH=DEST:$PYTHONPATH python -m vidattn.bench ...
# finds it (it also needs triton and, for one of its modules, einops; the GPU image has both).
#   tools/peers/fastvideo_peer.sh DEST [VERSION]      (default VERSION 0.3.5, the one benchmarked)
set -euo pipefail
DEST=${1:?usage: tools/peers/fastvideo_peer.sh DEST [VERSION]}
VERSION=${2:-0.3.5}
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The sdist (~42 MB; PyPI has no wheel): only its python/fastvideo_kernel folder is used.
"$PYTHON" -m pip download -q --no-deps "fastvideo-kernel==$VERSION" -d "$tmp"
tar -xzf "$tmp/fastvideo_kernel-$VERSION.tar.gz" -C "$tmp" \
  "fastvideo_kernel-$VERSION/python/fastvideo_kernel"
mkdir -p "$DEST"
rm -rf "$DEST/fastvideo_kernel"
cp -r "$tmp/fastvideo_kernel-$VERSION/python/fastvideo_kernel" "$DEST/"
echo "fastvideo_kernel $VERSION in $DEST (use PYTHONPATH=$DEST)"
