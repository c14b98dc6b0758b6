"""The Triton route's device resources: each device's idle staging rings and the side stream of
its staged copies, kept between transfers (allocating a ring or a stream per call would cost
more than the copies it serves). One ``DeviceResources`` per process (``device_resources``):
they belong to the devices, not to an engine."""

from __future__ import annotations

import functools
import threading

import torch


class DeviceResources:
    """Idle staging rings (at most MAX_IDLE_RINGS per device) and one side copy stream per device."""

    MAX_IDLE_RINGS = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rings: dict = {}  # device -> idle staging rings (uint8 device tensors)
        self.copy_streams: dict = {}  # device -> the side stream of the staged copies

    def acquire_ring(self, device: torch.device, nbytes: int) -> torch.Tensor:
        with self._lock:
            idle = self.rings.setdefault(device, [])
            for i, ring in enumerate(idle):
                if ring.numel() >= nbytes:
                    return idle.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release_ring(self, device: torch.device, ring: torch.Tensor) -> None:
        with self._lock:
            idle = self.rings.setdefault(device, [])
            if len(idle) < self.MAX_IDLE_RINGS:
                idle.append(ring)

    def copy_stream(self, device: torch.device, mod):
        with self._lock:
            side = self.copy_streams.get(device)
            if side is None:
                side = self.copy_streams[device] = mod.Stream(device)
        return side


@functools.cache
def device_resources() -> DeviceResources:
    return DeviceResources()
