"""The benchmarks' clock: this process's CPU time on the CPU, wall time after a synchronize on CUDA."""

from __future__ import annotations

import time

import torch

_device = "cpu"  # set once by `use_device` from a benchmark's --device


def use_device(device: str) -> None:
    """Time what runs on `device` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...) from now on."""
    global _device
    _device = device


def clock() -> float:
    """Seconds: this process's CPU time on the CPU; wall time after `torch.cuda.synchronize()` on CUDA."""
    if _device.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()
