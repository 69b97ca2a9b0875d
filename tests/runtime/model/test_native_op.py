"""`dsv4::dense` served by the native library's own kernel (`runtime.model.native_op`): registered
while its library serves the process, the same numbers as `Native.dense`, never entering Python
for what it multiplies, and handing the rest to the op's Python kernel."""

from __future__ import annotations

import pytest
import torch

from runtime.model import ops
from runtime.model.native import ISA_AVX2, ISA_BEST, ISA_SCALAR, load


def _fp8(rows_in: int, cols: int, block: int, gen):
    q = torch.randint(0, 127, (rows_in, cols), dtype=torch.uint8, generator=gen)
    q |= torch.randint(0, 2, q.shape, dtype=torch.uint8, generator=gen) << 7
    scale = torch.randint(118, 128, (rows_in // block, cols // block), dtype=torch.uint8, generator=gen)
    return q.view(torch.float8_e4m3fn), scale


def _has_cpu_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("dsv4::dense", "CPU")


class _Asked:
    """Native products that note every product asked of them in Python."""

    dense_rows = 8

    def __init__(self, real):
        self.real, self.asked = real, []

    def dense(self, x, w, scale=None):
        self.asked.append(x.shape[0])
        return self.real.dense(x, w, scale)


def test_the_library_serves_the_op_while_it_serves_the_process_with_the_same_numbers(native_library, serving,
                                                                                    monkeypatch):
    """Once `ops.use_native` takes the library, `dsv4::dense` on the cpu is its kernel: each product
    the very numbers `Native.dense` makes (every instruction set this cpu has; rows a stride apart
    too), and no product asked of Python; released, the op's Python kernel serves again, the same numbers."""
    native = load(native_library)
    serving(native)
    if not _has_cpu_kernel():
        pytest.skip("torch has no stable ABI headers here: the op stays Python's")
    gen = torch.Generator().manual_seed(1)
    fp8, bf16 = _fp8(256, 96, 32, gen), (torch.randn(128, 80, generator=gen).bfloat16(), None)
    asked = _Asked(native)
    monkeypatch.setattr(ops, "_native_dense", asked)  # Python's kernel would ask it
    for isa in (ISA_SCALAR, ISA_AVX2, ISA_BEST):
        native.isa = isa
        for w, scale in (fp8, bf16):
            for rows in (r for r in (1, 2, 4, 5, 8) if r <= native.dense_rows):  # plain C: up to 4
                x = torch.randn(rows, w.shape[0], generator=gen)
                assert torch.equal(torch.ops.dsv4.dense(x, w, scale), native.dense(x, w, scale))
                # rows a stride apart (a program's slice of a wider activation): gathered by the kernel
                wide = torch.randn(rows, w.shape[0] + 24, generator=gen)[:, 8:8 + w.shape[0]]
                assert torch.equal(torch.ops.dsv4.dense(wide, w, scale), native.dense(wide.contiguous(), w, scale))
    assert asked.asked == []
    monkeypatch.undo()
    serving(None)
    assert not _has_cpu_kernel()
    x = torch.randn(3, 256, generator=gen)
    serving(native)
    want = torch.ops.dsv4.dense(x, *fp8)
    serving(_Asked(native))  # not a library: the op's Python kernel asks it
    assert not _has_cpu_kernel() and torch.equal(torch.ops.dsv4.dense(x, *fp8), want)


def test_what_the_kernel_does_not_multiply_goes_to_the_python_kernel(native_library, serving):
    """More rows than `dense_rows` (a GEMM of the widened weight is faster there), a transposed x,
    a weight of another dtype: each what the op's Python kernel computes (`ops.dense`)."""
    native = load(native_library)
    serving(native)
    gen = torch.Generator().manual_seed(2)
    q, scale = _fp8(128, 64, 32, gen)
    many = torch.randn(native.dense_rows + 1, 128, generator=gen)
    assert torch.equal(torch.ops.dsv4.dense(many, q, scale), ops.dense(many, q, scale))
    xt = torch.randn(128, 3, generator=gen).t()
    assert torch.equal(torch.ops.dsv4.dense(xt, q, scale), native.dense(xt.contiguous(), q, scale))
    f32 = torch.randn(128, 64, generator=gen)
    assert torch.allclose(torch.ops.dsv4.dense(xt, f32, None), xt @ f32, rtol=1e-5, atol=1e-5)


def test_an_exported_programs_products_run_the_kernel(native_library, serving, monkeypatch):
    """A program calling `dsv4::dense` (as every layer program does, traced) runs the library's
    kernel once it serves: no product asked of Python, the numbers `Native.dense` makes."""
    native = load(native_library)
    serving(native)
    if not _has_cpu_kernel():
        pytest.skip("torch has no stable ABI headers here: the op stays Python's")
    gen = torch.Generator().manual_seed(3)
    q, scale = _fp8(128, 64, 32, gen)

    class Program(torch.nn.Module):
        def forward(self, x, q, scale):
            return torch.ops.dsv4.dense(torch.relu(x), q, scale) * 2

    x = torch.randn(2, 128, generator=gen)
    program = torch.export.export(Program(), (x, q, scale)).module()
    asked = _Asked(native)
    monkeypatch.setattr(ops, "_native_dense", asked)
    assert torch.equal(program(x, q, scale), native.dense(torch.relu(x), q, scale) * 2)
    assert asked.asked == []


def test_native_restored_puts_back_what_served_before_even_after_an_error(native_library):
    before = ops._native_dense
    with pytest.raises(RuntimeError, match="mid-block"), ops.native_restored():
        ops.use_native(load(native_library))
        assert ops._native_dense is not before
        raise RuntimeError("mid-block")
    assert ops._native_dense is before
