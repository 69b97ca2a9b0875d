"""`dsv4::dense` served natively: the native library's own kernel of the op for the CPU, so a
program's call of it (AOTInductor's, through the dispatcher) never enters Python. Its C++ source,
appended to the library's (`native.SOURCE`), through torch's stable C ABI (`torch/csrc/stable`:
header-only, so the library still compiles in seconds; it links against `libtorch_cpu`, which a
process loading it has loaded already).

Run by Python, the op cost a decode step of `small` some 171 round trips of about 27 us each
(the dispatcher boxing its arguments for a Python kernel, the GIL, the kernel's checks): 4.6 ms a
step, against 1.4 for every such product's own work at one row. The library's kernel checks what
`Native.dense` checks and multiplies at up to `Native.dense_rows` rows; anything else it hands to
`dsv4::dense_eager` (`runtime.model.ops.dense`, the Python kernel: a GEMM of the widened
weight), so every call computes what the Python kernel would.

The kernel is registered while its library serves the process (`ops.use_native`): one library's
at a time (`dsv4_ops_register` replaces none; `ops.use_native` releases the one before), over the
op's Python kernel (`CompositeExplicitAutograd`, which a kernel for the CPU takes precedence
over), which serves again once it is released. A torch without the stable ABI's headers builds
the library without it (`DSV4_OPS` undefined): the op stays Python's.
"""

OP_SOURCE = r"""
#if defined(DSV4_OPS) && __has_include(<torch/csrc/stable/library.h>)
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <array>
#include <optional>

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

static torch::stable::detail::StableLibrary *dsv4_ops = nullptr;
static int dsv4_ops_isa = 0;
static int64_t dsv4_ops_rows = 0;  /* the most rows multiplied here: more go to dsv4::dense_eager */

/* the FP8 weight's block scales as `Native.dense` takes them */
static bool dense_scale_ok(const Tensor &w, const Tensor &s) {
    if (s.dim() != 2 || s.scalar_type() != ScalarType::Byte || !s.is_cpu() || s.stride(1) != 1) return false;
    const int64_t gi = s.size(0), go = s.size(1);
    return 0 < gi && gi <= w.size(0) && go > 0 && w.size(0) % gi == 0 && w.size(1) % go == 0
           && (w.size(1) / go) % DENSE_UNIT == 0 && w.size(0) / gi <= DENSE_MAX_BLOCK;
}

static Tensor dense_op(Tensor x, Tensor w, std::optional<Tensor> scale) {
    bool ok = x.dim() == 2 && w.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_cpu() && w.is_cpu()
              && (x.is_contiguous() || (x.stride(1) == 1 && x.stride(0) >= x.size(1))) && x.size(1) == w.size(0)
              && w.stride(1) == 1 && w.size(1) > 0
              && x.size(0) <= dsv4_ops_rows && (w.size(1) >= DENSE_UNIT || x.size(0) <= 4);
    const bool fp8 = ok && w.scalar_type() == ScalarType::Float8_e4m3fn;
    ok = ok && (fp8 ? scale.has_value() && dense_scale_ok(w, *scale)
                    : w.scalar_type() == ScalarType::BFloat16 && !scale.has_value());
    if (!ok) {
        std::array<StableIValue, 3> stack{torch::stable::detail::from(x), torch::stable::detail::from(w),
                                         torch::stable::detail::from(scale)};
        STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("dsv4::dense_eager", "", stack.data(), TORCH_ABI_VERSION));
        return torch::stable::detail::to<Tensor>(stack[0]);
    }
    const int64_t rows = x.size(0), in = w.size(0), cols = w.size(1);
    Tensor out = torch::stable::new_empty(x, {rows, cols});
    /* rows a stride apart (a slice of a wider activation: a program's split of its projections)
       made contiguous here: handed to dsv4::dense_eager they cost a Python round trip each (100 us
       at 8 rows) */
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    const float *xp = (const float *)x.data_ptr();
    if (rows) {
        const int64_t bi = fp8 ? in / scale->size(0) : 1, bo = fp8 ? cols / scale->size(1) : 1;
        dsv4_dense(xp, rows, in, (const uint8_t *)w.data_ptr(), w.stride(0), fp8,
                   fp8 ? (const uint8_t *)scale->data_ptr() : nullptr, fp8 ? scale->stride(0) : 0, bi, bo,
                   (float *)out.data_ptr(), cols, (int)torch::stable::get_num_threads(), dsv4_ops_isa);
    }
    return out;
}

/* the instruction set and the most rows the kernel multiplies (`Native.isa`, `Native.dense_rows`) */
extern "C" void dsv4_ops_configure(int isa, int64_t rows) {
    dsv4_ops_isa = isa;
    dsv4_ops_rows = rows;
}

extern "C" int dsv4_ops_register(void) {
    if (dsv4_ops == nullptr) {
        dsv4_ops = new torch::stable::detail::StableLibrary(torch::stable::detail::StableLibrary::Kind::IMPL, "dsv4",
                                                           "CPU", __FILE__, __LINE__);
        dsv4_ops->impl("dense", TORCH_BOX(&dense_op));
    }
    return 1;
}

extern "C" void dsv4_ops_release(void) {
    delete dsv4_ops;
    dsv4_ops = nullptr;
}
#endif
"""


def op_flags() -> list[str]:
    """The compiler flags that build OP_SOURCE in: torch's headers and `libtorch_cpu` (found beside
    the torch this process imports; its version is in every program's key); none where torch has
    no stable ABI headers (the op then stays Python's)."""
    from pathlib import Path

    import torch

    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "torch" / "csrc" / "stable" / "library.h").is_file() or not lib.is_dir():
        return []
    return ["-DDSV4_OPS", f"-I{include}", f"-L{lib}", "-ltorch_cpu"]
