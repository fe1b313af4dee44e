// The name of the op library the kernels register (torch.ops.<name>): baton_cpu, unless a
// build asks for another. The tests build a second copy of the kernels for another
// instruction set under another name beside the native one (cpu_ops.build_variant), so
// that both copies' ops load into one process.
#pragma once

#ifndef BATON_CPU_LIB
#define BATON_CPU_LIB baton_cpu
#endif
