# The setup the GPU-machine scripts share (fuzz.sh, branch_check.sh, e2e.sh, bwd_check.sh):
# sourced from the tree's root, it defines two functions and runs nothing.

# The GPU machine has no network: the wheels carried in .whl/ (nvidia-cutlass for the Hopper
# build, diffusers and its dependencies) go to /tmp/vidattn-site, put first on PYTHONPATH.
install_carried_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || return 0
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/vidattn-site .whl/*.whl &&
    export PYTHONPATH=/tmp/vidattn-site${PYTHONPATH:+:$PYTHONPATH}
}

# build_ops BUILD_DIR: builds this tree's op library in BUILD_DIR (tools/gpu/build_ops.sh,
# JOBS or nproc jobs, log in $OUT/build.log) and says when it finished, counting from $t0; on
# a failure it prints the log's errors and returns 1.
build_ops() {
  if ! bash tools/gpu/build_ops.sh . "$1" "${JOBS:-$(nproc)}" >"$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -n 30
    echo "build failed at $((SECONDS - t0))s"
    return 1
  fi
  echo "build done at $((SECONDS - t0))s"
}
