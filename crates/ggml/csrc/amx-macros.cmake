# Included into llama.cpp's CMake projects (CMAKE_PROJECT_INCLUDE, set by
# .cargo/config.toml): force-includes amx-macros.h into every C and C++ file, so that a
# clang before 16 (Debian 12's clang 14) compiles ggml's AMX kernels (see the header).
if (CMAKE_C_COMPILER_ID MATCHES "Clang|GNU")
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:SHELL:-include ${CMAKE_CURRENT_LIST_DIR}/amx-macros.h>")
endif()
