"""TEST HARNESS stand-in for torchvision: PyPI has no CPU torchvision for torch 2.13 and the
CUDA build fails to load on CPU (``operator torchvision::nms does not exist``). SGLang's
engine module imports it (``torchvision.transforms`` for image models, and transformers'
processors import ``torchvision.io``); a text-only model never calls it. Every submodule
is a stub module whose attributes are placeholder classes that raise when instantiated.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvconnect-test-stub"


class _AnyAttr(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Missing,), {"__module__": cls.__module__})


class _Missing(metaclass=_AnyAttr):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stub in the kvconnect SGLang test harness")

    def __class_getitem__(cls, item):
        return cls


def _attr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Missing,), {"__module__": module_name})

    return __getattr__


class _StubModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _attr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubModules())
__getattr__ = _attr(__name__)
