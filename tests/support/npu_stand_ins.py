"""Stand-ins that let vLLM-Ascend's own Python import and run on a CPU machine (test harnesses only).

Used by both vLLM-Ascend harnesses (tests/ascend/harness.py for 0.23, tests/ascend013/harness013.py
for 0.13): ``install()`` puts placeholder packages for ``torch_npu``, ``acl`` and ``torchvision``
on the import path and a ``torch.npu`` that reports no device. A placeholder's attributes are
classes that raise when instantiated, so the product code imports but an NPU call never passes
silently. ``bare_module`` and ``ns`` build the layer modules and config namespaces a harness sets
by hand instead of loading a model.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STAND_IN_ROOTS = ("torch_npu", "acl", "torchvision")


class AbsentMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return absent(f"{cls.__qualname__}.{name}")


class Absent(metaclass=AbsentMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__}: an NPU stand-in was called on a CPU test machine")


def absent(path: str) -> type:
    return AbsentMeta(path.rsplit(".", 1)[-1], (Absent,), {"__qualname__": path})


def stand_in_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []

    def __getattr__(attr, _name=name):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return absent(f"{_name}.{attr}")

    module.__getattr__ = __getattr__
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STAND_IN_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return stand_in_module(spec.name)

    def exec_module(self, module):
        pass


def install() -> None:
    """The stand-in finder (once) and a ``torch.npu`` without devices; idempotent."""
    if not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
    import torch

    if not hasattr(torch, "npu"):
        torch.npu = stand_in_module("torch.npu", is_available=lambda: False, device_count=lambda: 0)


def ns(**kw):
    return types.SimpleNamespace(**kw)


def bare_module(cls, **attrs):
    """An ``nn.Module`` of ``cls`` made without its ``__init__``, with ``attrs`` set."""
    import torch

    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for key, value in attrs.items():
        object.__setattr__(obj, key, value)
    return obj
