# Finds NCCL and the CUDA runtime for Sinew's NCCL backend and defines
# SinewNCCL::nccl. Hints: NCCL_HOME, CUDA_HOME, /usr/local/cuda.
find_path(SINEW_NCCL_INCLUDE_DIR nccl.h
  HINTS ENV NCCL_HOME ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES include)
find_library(SINEW_NCCL_LIBRARY nccl
  HINTS ENV NCCL_HOME ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES lib64 lib)
find_path(SINEW_CUDART_INCLUDE_DIR cuda_runtime_api.h
  HINTS ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES include)
find_library(SINEW_CUDART_LIBRARY cudart
  HINTS ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES lib64 lib)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(SinewNCCL DEFAULT_MSG SINEW_NCCL_INCLUDE_DIR
  SINEW_NCCL_LIBRARY SINEW_CUDART_INCLUDE_DIR SINEW_CUDART_LIBRARY)
if(SinewNCCL_FOUND AND NOT TARGET SinewNCCL::nccl)
  add_library(SinewNCCL::nccl INTERFACE IMPORTED)
  set_target_properties(SinewNCCL::nccl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${SINEW_NCCL_INCLUDE_DIR};${SINEW_CUDART_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${SINEW_NCCL_LIBRARY};${SINEW_CUDART_LIBRARY}")
endif()
