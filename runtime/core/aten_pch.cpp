// The one file ATen's precompiled header is built with (target ft_aten_header, in
// runtime/CMakeLists.txt); every target that includes ATen reuses it (ft_aten_pch). Nothing else:
// a target of its own, so using the header builds no library a build does not otherwise need (the
// fuzz build has no model).
