# OpenMP (threads of the CPU backend), OpenBLAS (CPU block products), nvcc (CUDA backends).
find_package(OpenMP REQUIRED COMPONENTS CXX)

set(VIDATTN_HAVE_CBLAS OFF)
if(VIDATTN_USE_BLAS)
  # Prefer Debian's single-threaded OpenBLAS: vidattn runs one BLAS call per thread itself.
  set(_openblas_hints
    /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-serial
    /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-serial)
  find_library(VIDATTN_CBLAS_LIBRARY NAMES openblas HINTS ${_openblas_hints})
  find_path(VIDATTN_CBLAS_INCLUDE_DIR cblas.h HINTS ${_openblas_hints}
    PATH_SUFFIXES openblas)
  if(VIDATTN_CBLAS_LIBRARY AND VIDATTN_CBLAS_INCLUDE_DIR)
    set(VIDATTN_HAVE_CBLAS ON)
    message(STATUS "vidattn: CPU block products on OpenBLAS ${VIDATTN_CBLAS_LIBRARY}")
  else()
    message(STATUS "vidattn: OpenBLAS not found; CPU block products use plain loops (slow)")
  endif()
endif()

set(VIDATTN_CUDA_ENABLED OFF)
if(VIDATTN_CUDA STREQUAL "ON" OR VIDATTN_CUDA STREQUAL "AUTO")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(VIDATTN_CUDA_ENABLED ON)
  elseif(VIDATTN_CUDA STREQUAL "ON")
    message(FATAL_ERROR "VIDATTN_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "vidattn: CUDA sources ${VIDATTN_CUDA_ENABLED}")
