// Replay of a captured decode step (kernels/graph.py): a list of kernel calls recorded from the
// model's own forward, run in order in one call from Python. Each op is (invoker, kernel address,
// offset of its arguments in `args`); the invoker, from the kernel's library registry (registry.h),
// unpacks the arguments in the kernel's declared types. This file knows no kernel by name.

#include "isa_level.h"
#include <chrono>
#include <cstdint>

#include "registry.h"

extern "C" {

// Runs ops[0 : 3 * num_ops]. Returns 0; or the failing kernel's code (> 0) with its op index in
// *failed_op, the ops before it having run. With `nanoseconds` non-null, adds op i's wall time to
// nanoseconds[i].
int hs_graph_run(const int64_t* ops, int64_t num_ops, const int64_t* args, int64_t* failed_op, int64_t* nanoseconds) {
  for (int64_t i = 0; i < num_ops; ++i) {
    const auto invoke = reinterpret_cast<hs_registry::Invoker>(static_cast<intptr_t>(ops[3 * i]));
    const void* fn = reinterpret_cast<const void*>(static_cast<intptr_t>(ops[3 * i + 1]));
    const int64_t* a = args + ops[3 * i + 2];
    int rc;
    if (nanoseconds != nullptr) {
      const auto start = std::chrono::steady_clock::now();
      rc = invoke(fn, a);
      nanoseconds[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                            .count();
    } else {
      rc = invoke(fn, a);
    }
    if (rc != 0) {
      *failed_op = i;
      return rc;
    }
  }
  return 0;
}

}  // extern "C"

HS_REGISTRY(HS_KERNEL(hs_graph_run))
