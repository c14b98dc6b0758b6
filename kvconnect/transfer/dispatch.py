"""Which kernel moves a transfer, and the one entry that validates and runs it.

    gather(layout, tables, buffer)   # paged planes -> buffer  (store)
    scatter(layout, tables, buffer)  # buffer -> paged planes  (retrieve)

``buffer`` is a 1-D uint8 tensor (a CPU pool, pinned when the KV lives on an accelerator).
Dispatch (``backend=None``): the compiled CPU kernel for ``cpu`` planes, the compiled CUDA
kernel for ``cuda`` planes when it is built, the Triton route (triton_route.py) for Ascend
``npu`` planes when an NPU is present and Triton for the NPU (triton-ascend) is importable (its kernels
compiled and checked by ``prepare`` when the engine is created; any compile or launch failure: one
WARNING and the torch path for the rest of the process), the torch implementation
for anything else (logged once where a kernel was wanted). ``backend`` forces one of
``"cpu"``, ``"cuda"``, ``"triton"``, ``"torch"``; ``route_backend`` maps the configured
``KVCONNECT_TRANSFER_ROUTE`` to it. Every call is validated (``tables.validate``) before a pointer
crosses (the same TransferError whatever the backend); both calls return when the bytes have landed.

What the process learned about its routes (a Triton failure per device type, the devices whose
kernels are warm, the fallbacks already logged) is one ``RouteHealth``, made on first use by
``route_health()``: a Triton install that failed once fails for every engine of the process, so
the answer is shared, not re-learned per engine. The compiled kernels come from ``kernels``'
cached loaders (None when not built).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import TransferError
from ..layout.kv_layout import KVLayout
from ..throttled_warning import OnceWarnings
from . import torch_impl, triton_launch, triton_route
from .kernels import cpu_kernels, cuda_kernels
from .tables import TransferTables, plane_table, validate

logger = logging.getLogger(__name__)

BACKENDS = ("cpu", "cuda", "triton", "torch")
ROUTES = ("auto", "compiled", "triton", "torch")  # Config.transfer_route (KVCONNECT_TRANSFER_ROUTE)


@dataclass
class RouteHealth:
    """What this process learned about its transfer routes, per device type."""

    triton_failed: dict[str, str] = field(default_factory=dict)  # device type -> "stage: reason" of the first failure
    triton_warm: set[str] = field(default_factory=set)  # kernels compiled and checked (prepare)
    fallbacks: OnceWarnings = field(default_factory=lambda: OnceWarnings(logger.warning))  # one line per device type

    def fallback(self, device: str, why: str) -> str:
        self.fallbacks.warn(device, "kvconnect: %s planes take the torch transfer path (%s)", device, why)
        return "torch"

    def give_up_triton(self, device_type: str, exc: "triton_launch.TritonRouteError") -> None:
        """One WARNING, then the torch path for every later transfer on this device type."""
        if device_type not in self.triton_failed:
            self.triton_failed[device_type] = str(exc)
            logger.warning("kvconnect: the Triton transfer route failed on %s planes at the %s stage (%s); the torch "
                           "path serves them for the rest of this process", device_type, exc.stage, exc.reason)


@functools.cache
def route_health() -> RouteHealth:
    return RouteHealth()


def route_backend(layout: KVLayout, route: str) -> Optional[str]:
    """The backend a configured route forces for these planes (None: ``backend_for``'s choice)."""
    if route not in ROUTES:
        raise TransferError(f"unknown transfer route {route!r} (one of {', '.join(ROUTES)})")
    if route == "auto":
        return None
    if route == "compiled":
        device = layout.device.type
        if device not in ("cpu", "cuda"):
            raise TransferError(f"no compiled transfer kernel for {device} planes (KVCONNECT_TRANSFER_ROUTE=compiled)")
        return device
    return route


def triton_failure(device_type: str) -> Optional[str]:
    """Why the Triton route was given up on this device type in this process (None: it was not)."""
    return route_health().triton_failed.get(device_type)


def prepare(layout: KVLayout, requested: Optional[str] = None) -> str:
    """``backend_for``, and where that is the Triton route on a device (not the interpreter), its kernels
    compiled and checked now (``triton_route.warm_up``) rather than on the first store. A failure there
    is logged once and the torch path takes over; returns the backend transfers will take."""
    chosen = backend_for(layout, requested)
    device = layout.device.type
    if chosen != "triton":
        return chosen
    health = route_health()
    if device in health.triton_failed:
        return "torch"
    if device not in health.triton_warm:
        try:
            triton_route.warm_up(layout)
        except triton_launch.TritonRouteError as exc:
            health.give_up_triton(device, exc)
            return "torch"
        health.triton_warm.add(device)
    return chosen


def backend_for(layout: KVLayout, requested: Optional[str] = None) -> str:
    """The backend a transfer on these planes takes: ``requested`` checked, or the best available."""
    if requested is not None:
        if requested not in BACKENDS:
            raise TransferError(f"unknown transfer backend {requested!r}")
        if requested == "cpu" and (cpu_kernels() is None or layout.device.type != "cpu"):
            raise TransferError("the compiled CPU kernel needs cpu planes and a built kvconnect._cpu_kernels")
        if requested == "cuda" and (cuda_kernels() is None or layout.device.type != "cuda"):
            raise TransferError("the compiled CUDA kernel needs cuda planes and a built kvconnect._cuda_kernels")
        if requested == "triton" and not triton_launch.available(layout.device.type):
            raise TransferError(f"the Triton route needs Triton for {layout.device.type} "
                                "(triton on CUDA, triton-ascend on an NPU, TRITON_INTERPRET=1 on cpu planes)")
        return requested
    device = layout.device.type
    if device == "cpu" and cpu_kernels() is not None:
        return "cpu"
    if device == "cuda" and cuda_kernels() is not None:
        return "cuda"  # the compiled kernel until the Triton route measures faster on a GPU (docs/gpu.md)
    if device == "npu":
        if device in route_health().triton_failed:
            return "torch"  # logged when it failed
        if triton_launch.available("npu"):
            return "triton"
        return route_health().fallback(device, "no NPU is visible to torch_npu, or Triton for the NPU (triton-ascend) is not importable")
    if device in ("cpu", "cuda"):
        return route_health().fallback(device, f"kvconnect._{device}_kernels is not built")
    return "torch"


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def _run(direction: str, layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, backend: Optional[str], num_threads: int,
         cuda_tuning, triton_tuning) -> None:
    chosen = backend_for(layout, backend)
    if chosen != "cuda":  # the CUDA wrapper checks the buffer, its C++ side every index (O(slots + segments))
        validate(layout, tables, buffer, exact_slots=chosen in ("torch", "triton"))
    if not len(tables.segments):
        return
    if chosen == "cpu":
        if buffer.device.type != "cpu":
            raise TransferError("the CPU kernel needs a CPU buffer")
        kernels = cpu_kernels()
        fn = kernels.gather if direction == "gather" else kernels.scatter
        try:
            fn(plane_table(layout), tables.segments, tables.slots, buffer.data_ptr(), buffer.numel(), num_threads)
        except (IndexError, ValueError) as exc:
            raise TransferError(str(exc)) from exc
    elif chosen == "cuda":
        from . import cuda as cuda_backend

        cuda_backend.run(direction, layout, tables, buffer, tuning=cuda_tuning)
    elif chosen == "triton" and layout.device.type not in route_health().triton_failed:
        try:
            triton_route.run(direction, layout, tables, buffer, tuning=triton_tuning)
        except triton_launch.TritonRouteError as exc:  # never a failed transfer: the torch path redoes all of it
            route_health().give_up_triton(layout.device.type, exc)
            (torch_impl.gather if direction == "gather" else torch_impl.scatter)(layout, tables, buffer)
            _sync(layout.device)
    else:
        (torch_impl.gather if direction == "gather" else torch_impl.scatter)(layout, tables, buffer)
        _sync(layout.device)


def gather(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, backend: Optional[str] = None, num_threads: int = 1,
           cuda_tuning=None, triton_tuning=None) -> None:
    """Copy the rows named by ``tables`` from the paged planes into ``buffer``.

    ``num_threads`` is for the CPU kernel, ``cuda_tuning`` (a ``cuda.KernelTuning``) for the CUDA one,
    ``triton_tuning`` (a ``triton_launch.TritonTuning``) for the Triton route."""
    _run("gather", layout, tables, buffer, backend, num_threads, cuda_tuning, triton_tuning)


def scatter(layout: KVLayout, tables: TransferTables, buffer: torch.Tensor, *, backend: Optional[str] = None, num_threads: int = 1,
            cuda_tuning=None, triton_tuning=None) -> None:
    """Copy rows from ``buffer`` into the paged planes at the slots named by ``tables``."""
    _run("scatter", layout, tables, buffer, backend, num_threads, cuda_tuning, triton_tuning)
