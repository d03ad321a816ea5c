# CUDA backends: sm_80 (portable path) and sm_90a (Hopper path). Sources are added as the
# backends land under src/cuda/.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(VIDATTN_CUDA_GENCODE
  -gencode=arch=compute_80,code=sm_80
  -gencode=arch=compute_90a,code=sm_90a)
file(GLOB_RECURSE VIDATTN_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/cuda/*.cu)
if(VIDATTN_CUDA_SOURCES)
  target_sources(vidattn PRIVATE ${VIDATTN_CUDA_SOURCES})
  target_compile_options(vidattn PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${VIDATTN_CUDA_GENCODE}>)
  target_compile_definitions(vidattn PRIVATE VIDATTN_WITH_CUDA=1)
  target_link_libraries(vidattn PRIVATE CUDA::cudart)
endif()
