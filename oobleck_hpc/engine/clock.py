"""A rank's compute time in a step (`StepResult.compute_s`, what the straggler detection reads,
recovery/straggler.py): the time of its forward and backward computations only, not its waits
for peers. On CUDA that is the GPU's own time, from events on the compute stream."""

from __future__ import annotations

import time

import torch


class ComputeClock:
    """A rank's time in its forward and backward computations during a step
    (`StepResult.compute_s`): host time on the CPU; on CUDA the GPU's own, from events recorded
    on the compute stream around each computation (the host only launches kernels), read once
    the step synchronised anyway (its loss and norm on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def stop(self, start) -> None:
        if not self.cuda:
            self._host += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end))

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._host + sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
