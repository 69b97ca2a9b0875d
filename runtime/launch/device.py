"""One device interface for cpu, cuda and npu: memory, upload with progress, allocation.

On cpu, "device memory" is host memory, capped by `--device-memory` when given, so KV sizing
runs the same code everywhere (and a cap makes its failure paths testable here). torch_npu is
imported only when npu is chosen or probed by `auto`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import psutil
import torch

from runtime.launch.budget import Memory
from runtime.launch.hardware import resolve_device
from store.errors import UserError
from store.units import format_size

UPLOAD_CHUNK = 64 << 20
STAGING_BUFFERS = 2


class DeviceError(UserError):
    """A device that cannot be used as asked."""


class OutOfMemory(RuntimeError):
    """An allocation that does not fit; KV sizing catches it and halves."""


Progress = Callable[[int, int], None]


class Device:
    kind = "cpu"

    def __init__(self, index: int = 0, cap: int | None = None):
        self.index, self.cap = index, cap
        self.allocated = 0  # bytes this process placed here (weights copied, KV caches)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.kind != "cpu" else torch.device("cpu")

    def memory(self) -> Memory:
        vm = psutil.virtual_memory()
        return Memory(vm.total, vm.available, vm.total - vm.available, "cpu").capped(self.cap, "cpu", self.allocated)

    def upload(self, tensors: dict[str, torch.Tensor], progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """Place tensors on the device. On cpu they already are: zero-copy, whether mapped
        from a sidecar or packed in memory (progress still reports the bytes made ready)."""
        total = sum(t.nbytes for t in tensors.values())
        if progress:
            progress(total, total)
        return dict(tensors)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.cap is not None and nbytes > self.memory().free:
            raise OutOfMemory(f"{format_size(nbytes)} does not fit in the {format_size(self.memory().free)} free")
        try:
            t = torch.zeros(shape, dtype=dtype, device=self.torch_device)
        except (RuntimeError, MemoryError) as e:
            raise OutOfMemory(str(e)) from None
        self.allocated += nbytes
        return t

    def free_bytes(self, nbytes: int) -> None:
        self.allocated = max(0, self.allocated - nbytes)

    def synchronize(self) -> None:
        pass

    def trim(self) -> None:
        """Give memory the allocator caches but no tensor holds back to the device, so that a
        reading of free memory counts only what is in use (nothing to give back on cpu)."""

    def release(self) -> None:
        self.allocated = 0
        self.trim()

    def describe(self) -> str:
        return f"{self.kind}:{self.index}" if self.kind != "cpu" else "cpu"


class _Accelerator(Device):
    """cuda and npu: chunked copies through pinned host buffers, with progress."""

    module_name = "cuda"
    staging_buffers = STAGING_BUFFERS  # 1: fill, copy, wait, in turn (the bench's baseline)

    def _mod(self):
        return getattr(torch, self.module_name)

    def memory(self) -> Memory:
        free, total = self._mod().mem_get_info(self.index)
        return Memory(total, free, total - free, self.describe()).capped(self.cap, self.kind)

    def upload(self, tensors: dict[str, torch.Tensor], progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """Each tensor's bytes, chunk by chunk, through two pinned buffers taken in turn: while
        the copy engine moves one buffer to the device, the host fills the other (from a mapped
        sidecar: its page faults and memcpy overlap the transfer instead of adding to it). A
        buffer is refilled only once its last copy has finished; progress counts bytes that
        have arrived."""
        total = sum(t.nbytes for t in tensors.values())
        buffers = [self._staging_buffer() for _ in range(self.staging_buffers)]
        in_flight: list[tuple[object, int] | None] = [None] * len(buffers)  # (event, bytes)
        chunk, out, done, turn = buffers[0].numel(), {}, 0, 0

        def wait(i: int) -> None:
            nonlocal done
            if in_flight[i] is not None:
                event, n = in_flight[i]
                event.synchronize()
                in_flight[i] = None
                done += n
                if progress:
                    progress(done, total)

        for name, t in tensors.items():
            dst = torch.empty(t.shape, dtype=t.dtype, device=self.torch_device)
            src, dst_bytes = t.contiguous().reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
            for start in range(0, src.numel(), chunk):
                n, i = min(chunk, src.numel() - start), turn % len(buffers)
                turn += 1
                wait(i)
                staging = buffers[i][:n]
                staging.copy_(src[start:start + n])
                self._copy_async(dst_bytes[start:start + n], staging)
                event = self._mod().Event()
                event.record(self._mod().current_stream(self.index))  # the stream the copy went on
                in_flight[i] = (event, n)
            out[name] = dst
            self.allocated += t.nbytes
        for _ in buffers:  # the oldest copy first: progress stays in order
            wait(turn % len(buffers))
            turn += 1
        return out

    def _copy_async(self, dst: torch.Tensor, staging: torch.Tensor) -> None:
        dst.copy_(staging, non_blocking=True)  # from pinned memory: returns once queued

    def _staging_buffer(self) -> torch.Tensor:
        # pinned host memory: the copy engine reads it directly, no bounce through pageable memory
        return torch.empty(UPLOAD_CHUNK, dtype=torch.uint8, pin_memory=True)

    def synchronize(self) -> None:
        self._mod().synchronize(self.index)

    def trim(self) -> None:
        self._mod().empty_cache()


class CudaDevice(_Accelerator):
    kind = "cuda"
    module_name = "cuda"


class NpuDevice(_Accelerator):
    kind = "npu"
    module_name = "npu"


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def get_device(name: str = "auto", cap: int | None = None, index: int = 0) -> Device:
    """The device `name` means (auto: `runtime.launch.hardware.resolve_device`, the resolver the
    plan and the console use too); `index`: which accelerator (a rank's LOCAL_RANK)."""
    name = resolve_device(name)
    if name == "cpu":
        return Device(cap=cap)
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda: torch sees no CUDA device (is this a CUDA build of torch?)")
        _check_index("cuda", index, torch.cuda.device_count())
        return CudaDevice(index, cap)
    if name == "npu":
        if not _npu_available():
            raise DeviceError("--device npu: torch_npu is not installed or sees no NPU (pip install -e '.[npu]')")
        _check_index("npu", index, torch.npu.device_count())  # type: ignore[attr-defined]
        return NpuDevice(index, cap)
    raise DeviceError(f"unknown device '{name}'; choose auto, cpu, cuda or npu")


def _check_index(kind: str, index: int, count: int) -> None:
    if index >= count:
        raise DeviceError(f"local rank {index} needs {kind}:{index} but this host has {count} {kind} "
                          f"device(s); run at most {count} ranks per host")
