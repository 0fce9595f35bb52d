// One op of the clover_cpu library declared and given its CPU kernel in one line, for the files that
// each define a single op: CLOVER_CPU_OP(name, "(args) -> returns") registers `name` with that schema
// and the function `name` of the same translation unit as its CPU kernel.
#pragma once

#include <torch/library.h>

#define CLOVER_CPU_OP(name, signature)                               \
  TORCH_LIBRARY_FRAGMENT(clover_cpu, m) { m.def(#name signature); }  \
  TORCH_LIBRARY_IMPL(clover_cpu, CPU, m) { m.impl(#name, &name); }
