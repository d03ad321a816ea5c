# The PyTorch op library: links libtorch of the Python environment that builds it. Torch's
# own CMake package is not used: it drags in its CUDA detection, which the op library (built
# on the torch-free core) does not need.
find_package(Python COMPONENTS Interpreter REQUIRED)
execute_process(
  COMMAND ${Python_EXECUTABLE} -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "VIDATTN_BUILD_TORCH needs torch importable by ${Python_EXECUTABLE}")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 VIDATTN_TORCH_DIR)
list(GET _torch_info 1 VIDATTN_TORCH_CXX11_ABI)
list(GET _torch_info 2 VIDATTN_TORCH_VERSION)
list(LENGTH _torch_info _torch_info_len)
set(VIDATTN_TORCH_CUDA_VERSION "")
if(_torch_info_len GREATER 3)
  list(GET _torch_info 3 VIDATTN_TORCH_CUDA_VERSION)
endif()
message(STATUS "vidattn: building the op library against torch ${VIDATTN_TORCH_VERSION} in ${VIDATTN_TORCH_DIR}")

add_library(vidattn_torch MODULE torch/ops.cpp torch/cuda_workspace.cpp torch/rope_ops.cpp torch/vsa_ops.cpp
  torch/vsa_combine_ops.cpp)
if(VIDATTN_TESTING)
  target_sources(vidattn_torch PRIVATE torch/testing_ops.cpp)
endif()
target_include_directories(vidattn_torch SYSTEM PRIVATE
  ${VIDATTN_TORCH_DIR}/include
  ${VIDATTN_TORCH_DIR}/include/torch/csrc/api/include)
target_compile_definitions(vidattn_torch PRIVATE
  _GLIBCXX_USE_CXX11_ABI=${VIDATTN_TORCH_CXX11_ABI})
target_link_libraries(vidattn_torch PRIVATE vidattn
  ${VIDATTN_TORCH_DIR}/lib/libtorch.so
  ${VIDATTN_TORCH_DIR}/lib/libtorch_cpu.so
  ${VIDATTN_TORCH_DIR}/lib/libc10.so)
# CUDA kernels of the ops: only when the core has its CUDA backend and this torch is a CUDA
# build (a CPU-only torch has no libtorch_cuda / libc10_cuda; the op library then stays CPU).
if(VIDATTN_HAVE_CUDA_SOURCES AND VIDATTN_TORCH_CUDA_VERSION
   AND EXISTS ${VIDATTN_TORCH_DIR}/lib/libtorch_cuda.so
   AND EXISTS ${VIDATTN_TORCH_DIR}/lib/libc10_cuda.so)
  message(STATUS "vidattn: op library registers CUDA kernels (torch CUDA ${VIDATTN_TORCH_CUDA_VERSION})")
  target_compile_definitions(vidattn_torch PRIVATE VIDATTN_TORCH_CUDA=1)
  target_link_libraries(vidattn_torch PRIVATE
    ${VIDATTN_TORCH_DIR}/lib/libtorch_cuda.so
    ${VIDATTN_TORCH_DIR}/lib/libc10_cuda.so
    CUDA::cudart)
else()
  message(STATUS "vidattn: op library without CUDA kernels")
endif()
set_target_properties(vidattn_torch PROPERTIES PREFIX "" OUTPUT_NAME "_vidattn_ops"
  CXX_VISIBILITY_PRESET hidden)
if(VIDATTN_HAVE_CBLAS)  # the BLAS build found at configure time, not whatever the loader picks
  set_target_properties(vidattn_torch PROPERTIES INSTALL_RPATH "${VIDATTN_CBLAS_LIBRARY_DIR}")
endif()
if(SKBUILD)
  install(TARGETS vidattn_torch LIBRARY DESTINATION vidattn)
endif()
