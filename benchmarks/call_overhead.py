"""Per-call overhead of the ways to reach a tiny C++ CPU kernel from Python, to choose the kernels' boundary.

The kernel is trivial (out[i] = a[i] * s over a 1x8 float32 tensor) and takes 15 scalar and pointer
arguments like ours, so what is timed is the boundary itself:

* ctypes, argtypes set: pointers precomputed, with ``t.data_ptr()`` taken per call, and through a thin
  wrapper class whose ``__call__(*args)`` forwards to the ctypes function and checks its return code;
* a ``TORCH_LIBRARY`` op built with ``torch.utils.cpp_extension.load_inline`` (build dir under /tmp),
  called as ``torch.ops.<ns>.<op>(...)``: functional (allocates its output) and out= (mutating) variants,
  the latter also through its pre-bound ``OpOverload`` (``.default``); ``torch.mul(out=)`` for reference;
* the replay floor: one ctypes call runs a C++ loop of 1000 ops, each calling the kernel through a
  function pointer with its arguments unpacked from 16 int64 slots (and, for scale, that loop run for
  one op per ctypes call: a 2-argument call with the 15 arguments prepacked).

Each figure is the median over repeats (interleaved across methods) of the mean ns per call over a
batch of calls, with torch at one thread and at its default thread count.

    python benchmarks/call_overhead.py [--calls 20000] [--repeats 5] [--rebuild]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch

KERNEL = r"""
#include <cstdint>
#include <cstring>
KERNEL_LINKAGE int k(int64_t n, const void* a, void* out, int64_t m, float s, int k1, int k2, int64_t stride,
                     const void* b, const void* c, float eps, int flags, int64_t t0, int64_t t1, void* scratch) {
    if (n < 0 || a == nullptr || out == nullptr || m < 1 || k1 < 0 || k2 < 0 || stride < n) return 1;
    (void)b; (void)c; (void)eps; (void)flags; (void)t0; (void)t1; (void)scratch;
    const float* x = static_cast<const float*>(a);
    float* y = static_cast<float*>(out);
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
    return 0;
}
"""

CTYPES_SRC = (
    '#define KERNEL_LINKAGE extern "C" __attribute__((noinline))\n'
    + KERNEL
    + r"""
typedef int (*kfn)(int64_t, const void*, void*, int64_t, float, int, int, int64_t, const void*, const void*,
                   float, int, int64_t, int64_t, void*);
static kfn volatile table[1] = {k};  // volatile: the call stays indirect, as in a program of many kernels
static inline float f32(int64_t v) { uint32_t u = (uint32_t)v; float f; std::memcpy(&f, &u, 4); return f; }
static inline void* p(int64_t v) { return reinterpret_cast<void*>(v); }

// ops: count x 16 int64 slots, [kernel index, 15 arguments]
extern "C" int replay(int64_t count, const int64_t* ops) {
    for (int64_t i = 0; i < count; ++i, ops += 16) {
        int rc = table[ops[0]](ops[1], p(ops[2]), p(ops[3]), ops[4], f32(ops[5]), (int)ops[6], (int)ops[7], ops[8],
                               p(ops[9]), p(ops[10]), f32(ops[11]), (int)ops[12], ops[13], ops[14], p(ops[15]));
        if (rc != 0) return rc;
    }
    return 0;
}
"""
)

TORCH_SRC = (
    "#include <ATen/core/Tensor.h>\n#include <ATen/ops/empty_like.h>\n#include <torch/library.h>\n"
    "#define KERNEL_LINKAGE static\n"
    + KERNEL
    + r"""
static void run(const at::Tensor& a, const at::Tensor& out, const at::Tensor& b, const at::Tensor& c,
                const at::Tensor& scratch, int64_t n, int64_t m, double s, int64_t k1, int64_t k2, int64_t stride,
                double eps, int64_t flags, int64_t t0, int64_t t1) {
    TORCH_CHECK(a.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && a.numel() >= n && out.numel() >= n);
    int rc = k(n, a.const_data_ptr(), out.mutable_data_ptr(), m, (float)s, (int)k1, (int)k2, stride,
               b.const_data_ptr(), c.const_data_ptr(), (float)eps, (int)flags, t0, t1, scratch.mutable_data_ptr());
    TORCH_CHECK(rc == 0, "k rejected its arguments (code ", rc, ")");
}
static at::Tensor k_functional(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                               const at::Tensor& scratch, int64_t n, int64_t m, double s, int64_t k1, int64_t k2,
                               int64_t stride, double eps, int64_t flags, int64_t t0, int64_t t1) {
    at::Tensor out = at::empty_like(a);
    run(a, out, b, c, scratch, n, m, s, k1, k2, stride, eps, flags, t0, t1);
    return out;
}
static void k_out(const at::Tensor& a, const at::Tensor& out, const at::Tensor& b, const at::Tensor& c,
                  const at::Tensor& scratch, int64_t n, int64_t m, double s, int64_t k1, int64_t k2, int64_t stride,
                  double eps, int64_t flags, int64_t t0, int64_t t1) {
    run(a, out, b, c, scratch, n, m, s, k1, k2, stride, eps, flags, t0, t1);
}
TORCH_LIBRARY(hs_overhead, m) {
    m.def("k(Tensor a, Tensor b, Tensor c, Tensor scratch, int n, int m, float s, int k1, int k2, int stride, "
          "float eps, int flags, int t0, int t1) -> Tensor");
    m.def("k_out(Tensor a, Tensor(a!) out, Tensor b, Tensor c, Tensor(b!) scratch, int n, int m, float s, int k1, "
          "int k2, int stride, float eps, int flags, int t0, int t1) -> ()");
}
TORCH_LIBRARY_IMPL(hs_overhead, CPU, m) {
    m.impl("k", &k_functional);
    m.impl("k_out", &k_out);
}
"""
)

I64, PTR, INT, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
K_ARGTYPES = [I64, PTR, PTR, I64, F32, INT, INT, I64, PTR, PTR, F32, INT, I64, I64, PTR]
REPLAY_OPS = 1000


class Kernel:
    """The thin wrapper our kernels are called through: forwards *args and checks the return code."""

    def __init__(self, fn, name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, *args) -> None:
        rc = self.fn(*args)
        if rc != 0:
            raise RuntimeError(f"{self.name} rejected its arguments (code {rc})")


def build_ctypes(tmp: str) -> tuple[ctypes.CDLL, float]:
    src, so = os.path.join(tmp, "k.cpp"), os.path.join(tmp, "k.so")
    with open(src, "w") as f:
        f.write(CTYPES_SRC)
    t = time.perf_counter()
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-o", so, src], check=True)
    seconds = time.perf_counter() - t
    lib = ctypes.CDLL(so)
    lib.k.argtypes, lib.k.restype = K_ARGTYPES, INT
    lib.replay.argtypes, lib.replay.restype = [I64, PTR], INT
    return lib, seconds


def build_torch_op(rebuild: bool) -> tuple[bool, str]:
    """Builds and loads the TORCH_LIBRARY op: whether it loaded, and a line saying how long it took or why not."""
    from torch.utils import cpp_extension

    build_dir = os.path.join(tempfile.gettempdir(), "hybridserve_call_overhead_ext")
    if rebuild:
        shutil.rmtree(build_dir, ignore_errors=True)
    cached = os.path.exists(os.path.join(build_dir, "hs_overhead.so"))
    os.makedirs(build_dir, exist_ok=True)
    t = time.perf_counter()
    try:
        cpp_extension.load_inline(
            "hs_overhead", [TORCH_SRC], extra_cflags=["-O2"], build_directory=build_dir,
            is_python_module=False, no_implicit_headers=True,
        )  # fmt: skip
    except Exception as e:  # report it and go on with the ctypes figures
        lines = str(e).strip().splitlines() or [""]
        why = next((line for line in lines if "error:" in line), lines[-1]).strip()[:300]
        return False, f"torch extension build failed ({type(e).__name__}: {why})"
    seconds = time.perf_counter() - t
    return True, f"torch extension: {seconds:.1f} s to load_inline ({'cached build' if cached else 'fresh build'})"


def methods(lib: ctypes.CDLL, have_op: bool) -> dict[str, Callable[[int], int]]:
    """name -> timer(calls): the ns that many kernel calls take."""
    a, out, b, c, scratch = (torch.randn(1, 8) for _ in range(5))

    def pointer_args() -> tuple:  # the timers take pointers from the tensors, which their closures keep alive
        return (8, a.data_ptr(), out.data_ptr(), 1, 0.5, 1, 2, 8, b.data_ptr(), c.data_ptr(), 1e-6, 0, 3, 4,
                scratch.data_ptr())  # fmt: skip

    fn, wrapped = lib.k, Kernel(lib.k, "k")
    assert fn(*pointer_args()) == 0 and torch.equal(out, a * 0.5)
    slots = [0, *pointer_args()]
    slots[5], slots[11] = (struct.unpack("<i", struct.pack("<f", slots[i]))[0] for i in (5, 11))
    ops = torch.tensor([slots] * REPLAY_OPS, dtype=torch.int64)
    replay = lib.replay
    out.zero_()
    assert replay(REPLAY_OPS, ops.data_ptr()) == 0 and torch.equal(out, a * 0.5)

    def ctypes_direct(n):
        args = pointer_args()
        t = time.perf_counter_ns()
        for _ in range(n):
            fn(*args)
        return time.perf_counter_ns() - t

    def ctypes_data_ptr(n):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn(8, a.data_ptr(), out.data_ptr(), 1, 0.5, 1, 2, 8, b.data_ptr(), c.data_ptr(), 1e-6, 0, 3, 4,
               scratch.data_ptr())  # fmt: skip
        return time.perf_counter_ns() - t

    def ctypes_wrapper(n):
        args = pointer_args()
        t = time.perf_counter_ns()
        for _ in range(n):
            wrapped(*args)
        return time.perf_counter_ns() - t

    def torch_mul_out(n):
        t = time.perf_counter_ns()
        for _ in range(n):
            torch.mul(a, 0.5, out=out)
        return time.perf_counter_ns() - t

    def cpp_replay(n):
        ops_ptr = ops.data_ptr()
        t = time.perf_counter_ns()
        for _ in range(n // REPLAY_OPS):
            replay(REPLAY_OPS, ops_ptr)
        return time.perf_counter_ns() - t

    def replay_one(n):
        ops_ptr = ops.data_ptr()
        t = time.perf_counter_ns()
        for _ in range(n):
            replay(1, ops_ptr)
        return time.perf_counter_ns() - t

    table = {
        "ctypes fn(*args), 15 args, pointers precomputed": ctypes_direct,
        "ctypes fn(...), 5x t.data_ptr() per call": ctypes_data_ptr,
        "wrapper(*args): __call__(*args) -> fn, rc check": ctypes_wrapper,
    }
    if have_op:
        ns = torch.ops.hs_overhead
        k_out = ns.k_out.default
        assert torch.equal(ns.k(a, b, c, scratch, 8, 1, 0.5, 1, 2, 8, 1e-6, 0, 3, 4), a * 0.5)
        out.zero_()
        k_out(a, out, b, c, scratch, 8, 1, 0.5, 1, 2, 8, 1e-6, 0, 3, 4)
        assert torch.equal(out, a * 0.5)

        def op_functional(n):
            t = time.perf_counter_ns()
            for _ in range(n):
                torch.ops.hs_overhead.k(a, b, c, scratch, 8, 1, 0.5, 1, 2, 8, 1e-6, 0, 3, 4)
            return time.perf_counter_ns() - t

        def op_out(n):
            t = time.perf_counter_ns()
            for _ in range(n):
                torch.ops.hs_overhead.k_out(a, out, b, c, scratch, 8, 1, 0.5, 1, 2, 8, 1e-6, 0, 3, 4)
            return time.perf_counter_ns() - t

        def op_out_bound(n):
            t = time.perf_counter_ns()
            for _ in range(n):
                k_out(a, out, b, c, scratch, 8, 1, 0.5, 1, 2, 8, 1e-6, 0, 3, 4)
            return time.perf_counter_ns() - t

        table["torch.ops.ns.k(...) functional (allocates)"] = op_functional
        table["torch.ops.ns.k_out(...) out= (mutating)"] = op_out
        table["k_out = torch.ops.ns.k_out.default; k_out(...)"] = op_out_bound
    table["torch.mul(a, s, out=out) (reference)"] = torch_mul_out
    table["ctypes replay(1, ops): one prepacked op per call"] = replay_one
    table[f"C++ replay loop, fn pointer, per op ({REPLAY_OPS}/call)"] = cpp_replay
    return table


def measure(table: dict, calls: int, repeats: int) -> dict[str, float]:
    """Median over repeats (methods interleaved) of ns per call."""
    calls = max(REPLAY_OPS, calls // REPLAY_OPS * REPLAY_OPS)
    for timer in table.values():  # warm up
        timer(calls // 10)
    samples: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(repeats):
        for name, timer in table.items():
            samples[name].append(timer(calls) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="kernel calls per timed batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the torch extension from scratch")
    a = parser.parse_args()

    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        lib, ctypes_build = build_ctypes(tmp)
        print(f"torch {torch.__version__}; ctypes .so: {ctypes_build:.2f} s to build (g++ -O2)")
        have_op, op_line = build_torch_op(a.rebuild)
        print(op_line)
        table = methods(lib, have_op)
        results = {}
        for threads in dict.fromkeys((1, default_threads)):
            torch.set_num_threads(threads)
            results[threads] = measure(table, a.calls, a.repeats)
        torch.set_num_threads(default_threads)

    width = max(map(len, table))
    heads = "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>12}" for t in results)
    print(f"\nmedian ns per call ({a.calls} calls x {a.repeats} repeats)\n{'method':<{width}}{heads}")
    for name in table:
        print(f"{name:<{width}}" + "".join(f"{r[name]:>12.0f}" for r in results.values()))


if __name__ == "__main__":
    main()
