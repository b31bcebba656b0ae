# Regenerates build_info.cpp (ft version, git commit, LibTorch version) on every build, rewriting it
# only when the content changes so nothing else recompiles.
set(FT_BUILD_INFO_CPP ${CMAKE_BINARY_DIR}/generated/build_info_values.cpp)
add_custom_target(ft_build_info_gen
  COMMAND ${CMAKE_COMMAND}
    -DOUT=${FT_BUILD_INFO_CPP} -DSRC=${CMAKE_SOURCE_DIR}
    -DFT_VERSION=${PROJECT_VERSION} -DTORCH_VERSION=${Torch_VERSION}
    -P ${CMAKE_SOURCE_DIR}/cmake/write_build_info.cmake
  BYPRODUCTS ${FT_BUILD_INFO_CPP}
  COMMENT "" VERBATIM)
