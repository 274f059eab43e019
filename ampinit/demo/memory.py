"""Peak memory of one level's run: CUDA's allocator counters, or on CPU the process RSS sampled while it trains, one
level at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading

import torch

import ampinit
from ampinit import amp
from ampinit.demo.workloads import _LEARNING_RATES, Task, initialize


class _PeakMemory:
    """Peak memory growth over a run: CUDA's allocator counters, or on CPU the process RSS sampled every 2 ms.

    On CPU, freed heap memory is handed back to the OS first (glibc ``malloc_trim``) so that memory cached from
    earlier runs does not hide this run's growth.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._peak = 0

    @staticmethod
    def method(device: torch.device) -> str:
        if device.type == "cuda":
            return "CUDA: torch.cuda.max_memory_allocated() minus the allocation before the model was built"
        if _rss_bytes() is not None:
            return (
                "CPU: growth of the process RSS (/proc/self/statm, sampled every 2 ms) over the run, from just before "
                "the model was built; freed heap memory is returned to the OS (malloc_trim) before each run"
            )
        return "not measured: no CUDA device and no /proc/self/statm on this OS"

    def __enter__(self) -> _PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        _malloc_trim()
        rss = _rss_bytes()
        if rss is not None:
            self._baseline = self._peak = rss
            self._thread = threading.Thread(target=self._sample, name="ampinit-demo-rss", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _rss_bytes() or 0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._peak = max(self._peak, _rss_bytes() or 0)

    def peak_mib(self) -> float | None:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self._baseline) / 2**20
        if self._thread is None:
            return None
        return (self._peak - self._baseline) / 2**20


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _malloc_trim() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_memory(task: Task, level: str, seed: int, device: torch.device, steps: int = 2) -> float | None:
    """Peak memory growth of building ``task`` at ``level`` and training ``steps`` steps, one level at a time
    (interleaved training keeps every level's model alive, so its memory cannot be told apart)."""
    with _PeakMemory(device) as memory:
        model = task.build(seed, device)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATES[task.name])
        model, optimizer = initialize(model, optimizer, level)
        session = ampinit.session_of(optimizer)
        try:
            batches = task.batches(seed)
            for _ in range(steps):
                inputs, target = next(batches)
                optimizer.zero_grad(set_to_none=True)
                with amp.scale_loss(task.loss(model(inputs), target), optimizer) as scaled_loss:
                    scaled_loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
        finally:
            if session is not None:
                session.close()
    return memory.peak_mib()
