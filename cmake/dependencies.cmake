# OpenMP (threads of the CPU backend), OpenBLAS (CPU block products), nvcc (CUDA backends).
find_package(OpenMP REQUIRED COMPONENTS CXX)

set(VIDATTN_HAVE_CBLAS OFF)
if(VIDATTN_USE_BLAS)
  # Debian's OpenMP build of OpenBLAS: vidattn calls it from its own OpenMP threads, where it
  # runs single-threaded, and it is safe to call concurrently (the serial build is not: it
  # shares one buffer pool without locks).
  set(_openblas_hints
    /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp
    /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp)
  find_library(VIDATTN_CBLAS_LIBRARY NAMES openblas HINTS ${_openblas_hints})
  find_path(VIDATTN_CBLAS_INCLUDE_DIR cblas.h HINTS ${_openblas_hints}
    PATH_SUFFIXES openblas)
  if(VIDATTN_CBLAS_LIBRARY AND VIDATTN_CBLAS_INCLUDE_DIR)
    set(VIDATTN_HAVE_CBLAS ON)
    get_filename_component(VIDATTN_CBLAS_LIBRARY_DIR "${VIDATTN_CBLAS_LIBRARY}" DIRECTORY)
    message(STATUS "vidattn: CPU block products on OpenBLAS ${VIDATTN_CBLAS_LIBRARY}")
  else()
    message(STATUS "vidattn: OpenBLAS not found; CPU block products use plain loops (slow)")
  endif()
endif()

set(VIDATTN_CUDA_ENABLED OFF)
set(VIDATTN_HAVE_CUDA_SOURCES OFF)  # set by cuda.cmake when src/cuda has sources
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
