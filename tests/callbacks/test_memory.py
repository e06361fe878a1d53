"""MemoryMonitor: the process's peak RSS on CPU (read back from /proc), CUDA's allocator
peak reset per epoch (torch.cuda faked), and the value where the views read it."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Loop
from hookloop.callbacks import MemoryMonitor
from hookloop.callbacks.memory import peak_rss_bytes


def vm_hwm_bytes() -> int:
    """The kernel's high-water mark of this process's resident set, as /proc says it."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


class AtEpochEnd(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []

    def on_epoch_end(self, loop) -> None:
        self.seen.append((loop.state.metrics["peak_memory_mib"], vm_hwm_bytes()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_on_cpu_the_value_is_the_process_peak_rss() -> None:
    model = torch.nn.Linear(6, 3)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    seen = AtEpochEnd()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=F.cross_entropy, callbacks=[MemoryMonitor(), seen], device="cpu")
    state = loop.fit(2)
    # The kernel keeps RSS counters per CPU and syncs them lazily, and reading /proc
    # allocates a little: the two readers agree within a MiB.
    for value, by_hand in seen.seen:
        assert value == pytest.approx(by_hand / 2**20, abs=1.0)
    assert peak_rss_bytes() == pytest.approx(vm_hwm_bytes(), abs=2**20)
    assert all("peak_memory_mib" in row for row in state.history)


def test_on_cuda_the_epoch_peak_of_the_allocator(monkeypatch) -> None:
    calls: list[tuple[str, object]] = []
    peaks = iter([3 * 2**20, 5 * 2**20, 7 * 2**20])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: calls.append(("read", device)) or next(peaks))
    device = torch.device("cuda", 1)
    loop = SimpleNamespace(device=device, batches_per_epoch=2,
                           state=SimpleNamespace(batch_idx=0, metrics={}))
    monitor = MemoryMonitor()
    monitor.on_epoch_start(loop)
    monitor.on_batch_end(loop)           # batch 0 of 2: nothing read
    loop.state.batch_idx = 1
    monitor.on_batch_end(loop)           # the last training batch
    assert loop.state.metrics["peak_memory_mib"] == 3.0
    monitor.on_validation_end(loop)
    assert loop.state.metrics["peak_memory_mib"] == 5.0
    monitor.on_epoch_end(loop)
    assert loop.state.metrics["peak_memory_mib"] == 7.0
    assert calls == [("reset", device)] + [("read", device)] * 3
