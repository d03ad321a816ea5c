include_guard(GLOBAL)
# CUTLASS / CuTe headers for the Hopper kernels (wgmma and TMA atoms, pipelines), pinned from
# PyPI (nvidia-cutlass ships them in cutlass_library/source/include). Header-only: nothing of
# it is installed with vidattn. VIDATTN_CUTLASS_INCLUDE overrides the lookup. Included by
# cuda.cmake and by tests/cpp (the sm_90a schedulers' host test builds without CUDA sources).
set(VIDATTN_CUTLASS_INCLUDE "" CACHE PATH "CUTLASS include directory (holds cute/ and cutlass/)")
if(NOT VIDATTN_CUTLASS_INCLUDE)
  find_package(Python COMPONENTS Interpreter QUIET)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python_EXECUTABLE} -c
        "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _vidattn_cutlass OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_vidattn_cutlass AND EXISTS "${_vidattn_cutlass}/cute/tensor.hpp")
      set(VIDATTN_CUTLASS_INCLUDE "${_vidattn_cutlass}" CACHE PATH "" FORCE)
    endif()
  endif()
endif()
