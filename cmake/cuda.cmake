# CUDA backend (src/cuda: dispatch/, common/, attention/sm80, attention/sm90, vsa/, rope/).
# Every .cu under src/cuda/ is compiled for both targets (an sm_90a kernel compiled for sm_80
# is an empty body the dispatch never launches); one instantiation per file keeps the build
# parallel.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# CMake before 3.26 knows no C++20 switch for nvcc (the core asks for C++20 everywhere).
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
# VIDATTN_CUDA_TARGETS picks a subset while developing (e.g. "90a" on a Hopper machine).
set(VIDATTN_CUDA_TARGETS "80;90a" CACHE STRING "GPU targets to compile: 80 and/or 90a")
set(VIDATTN_CUDA_GENCODE "")
foreach(_target IN LISTS VIDATTN_CUDA_TARGETS)
  list(APPEND VIDATTN_CUDA_GENCODE -gencode=arch=compute_${_target},code=sm_${_target})
endforeach()
# -O3 and -lineinfo (sanitizer / profiler source lines, no speed cost). No --use_fast_math:
# the kernels call the fast exp2 (ex2.approx) explicitly where they want it, as the sm_90a
# epilogue calls MUFU's reciprocal and log2 for the output's normaliser and the LSE; everything
# else stays IEEE.
set(VIDATTN_CUDA_FLAGS -O3 -lineinfo --expt-relaxed-constexpr)
file(GLOB_RECURSE VIDATTN_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/cuda/*.cu)
if(VIDATTN_CUDA_SOURCES)
  add_library(vidattn_cuda OBJECT ${VIDATTN_CUDA_SOURCES})
  # The -gencode list above is the only target list (no CMake default architecture).
  set_target_properties(vidattn_cuda PROPERTIES CUDA_ARCHITECTURES OFF
    POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  # Sources include each other as "cuda/common/params.h", from src/.
  target_include_directories(vidattn_cuda PRIVATE ${PROJECT_SOURCE_DIR}/include
    ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(vidattn_cuda PRIVATE ${VIDATTN_CUDA_GENCODE} ${VIDATTN_CUDA_FLAGS})
  target_compile_definitions(vidattn_cuda PRIVATE VIDATTN_WITH_CUDA=1
    $<$<BOOL:${VIDATTN_TESTING}>:VIDATTN_TESTING=1>)
  target_link_libraries(vidattn_cuda PRIVATE CUDA::cudart)
  target_sources(vidattn PRIVATE $<TARGET_OBJECTS:vidattn_cuda>)
  target_compile_definitions(vidattn PRIVATE VIDATTN_WITH_CUDA=1)
  target_link_libraries(vidattn PRIVATE CUDA::cudart)
  set(VIDATTN_HAVE_CUDA_SOURCES ON)
endif()

include(${CMAKE_CURRENT_LIST_DIR}/cutlass.cmake)
if(VIDATTN_CUTLASS_INCLUDE)
  message(STATUS "vidattn: CUTLASS headers at ${VIDATTN_CUTLASS_INCLUDE}")
  if(TARGET vidattn_cuda)
    target_include_directories(vidattn_cuda SYSTEM PRIVATE ${VIDATTN_CUTLASS_INCLUDE})
    target_compile_definitions(vidattn_cuda PRIVATE VIDATTN_WITH_CUTLASS=1)
  endif()
else()
  message(STATUS "vidattn: no CUTLASS headers (pip install nvidia-cutlass==4.2.0.0); the Hopper path is not built")
endif()
