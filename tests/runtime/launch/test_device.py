"""The device interface: cpu memory and caps, and the accelerator upload path driven through a
stand-in accelerator module (no GPU/NPU here; the same code runs against torch.cuda/torch_npu)."""

import itertools

import pytest
import torch

from runtime.launch.device import Device, DeviceError, OutOfMemory, _Accelerator, get_device


def test_cpu_memory_and_cap():
    d = get_device("cpu")
    m = d.memory()
    assert m.total > 0 and 0 <= m.free <= m.total and m.used == m.total - m.free
    capped = get_device("cpu", cap=1 << 20)
    assert capped.memory().total == 1 << 20
    t = capped.allocate((64, 1024))  # 256 KiB
    assert t.shape == (64, 1024) and capped.allocated == 256 * 1024
    assert capped.memory().free == (1 << 20) - 256 * 1024
    with pytest.raises(OutOfMemory):
        capped.allocate((1024, 1024))
    capped.release()
    assert capped.allocated == 0


def test_cpu_upload_is_zero_copy():
    d = Device()
    src = {"a": torch.arange(10, dtype=torch.float32)}
    seen = []
    out = d.upload(src, lambda done, total: seen.append((done, total)))
    assert out["a"].data_ptr() == src["a"].data_ptr() and seen == [(40, 40)]


def test_unavailable_accelerators_are_clear_errors():
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device"):
            get_device("cuda")
    with pytest.raises(DeviceError, match="torch_npu"):
        get_device("npu")
    with pytest.raises(DeviceError, match="unknown device"):
        get_device("tpu")
    assert get_device("auto").kind in ("cpu", "cuda", "npu")


class _FakeModule:
    """What the accelerator code asks of torch.cuda / torch.npu. A copy to the "device" is only
    queued (as on a real copy engine) and lands when an event recorded after it, or the device,
    is synchronised: a staging buffer refilled too early would land the wrong bytes."""

    def __init__(self):
        self.synced = self.emptied = self.events = 0
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.landed = 0

    def mem_get_info(self, index):
        return 3 << 30, 8 << 30

    def current_stream(self, index):
        return ("stream", index)

    def run_until(self, n):
        while self.landed < n:
            dst, src = self.queue[self.landed]
            dst.copy_(src)
            self.landed += 1

    def Event(self):  # torch.cuda.Event
        module = self

        class Event:
            def record(self, stream):
                assert stream == ("stream", 0)
                module.events += 1
                self.upto = len(module.queue)

            def synchronize(self):
                module.run_until(self.upto)

        return Event()

    def synchronize(self, index):
        self.synced += 1
        self.run_until(len(self.queue))

    def empty_cache(self):
        self.emptied += 1


class FakeAccelerator(_Accelerator):
    kind = "cpu"  # tensors land on the cpu so the copy can be checked byte for byte

    def __init__(self, chunk):
        super().__init__()
        self.fake, self.chunk = _FakeModule(), chunk

    def _mod(self):
        return self.fake

    def _staging_buffer(self):
        return torch.empty(self.chunk, dtype=torch.uint8)  # pinned memory needs a real device

    def _copy_async(self, dst, staging):
        self.fake.queue.append((dst, staging))


def test_accelerator_upload_overlaps_two_staging_buffers_and_never_refills_one_in_flight():
    dev = FakeAccelerator(chunk=1000)
    src = {"w": torch.randn(100, 37), "q": torch.randint(-127, 127, (5, 999), dtype=torch.int8),
           "empty": torch.empty(0, 4), "one": torch.tensor([7], dtype=torch.int64)}
    seen, in_flight = [], []
    out = dev.upload(src, lambda done, total: (seen.append((done, total)),
                                               in_flight.append(len(dev.fake.queue) - dev.fake.landed)))
    for k in src:
        assert torch.equal(out[k], src[k]) and out[k].shape == src[k].shape
        assert out[k].numel() == 0 or out[k].data_ptr() != src[k].data_ptr()
    total = sum(t.nbytes for t in src.values())
    chunks = sum(-(-t.nbytes // 1000) for t in src.values())
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(seen) == chunks == dev.fake.events == len(dev.fake.queue) == dev.fake.landed
    # while one buffer's bytes arrive, the other's copy is still on its way: they overlap, and
    # never more than the two buffers hold are in flight
    assert max(in_flight) == 1 and in_flight.count(1) >= chunks - 2
    # the transfers alternate between the two buffers
    buffers = [staging.untyped_storage().data_ptr() for _, staging in dev.fake.queue]
    assert len(set(buffers)) == 2 and all(a != b for a, b in itertools.pairwise(buffers))
    assert dev.allocated == total
    m = dev.memory()
    assert (m.total, m.free, m.used) == (8 << 30, 3 << 30, 5 << 30)
    dev.trim()
    assert dev.fake.emptied == 1
    dev.release()
    assert dev.fake.emptied == 2 and dev.allocated == 0
