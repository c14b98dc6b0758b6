"""TEST HARNESS stand-in: an import stub for ``torchvision``.

vLLM's ``qwen3_5.py`` imports ``qwen3_vl``, whose image processor imports torchvision (and
transformers' image utilities import ``torchvision.io`` once torchvision is importable); the
text-only ``Qwen3_5ForCausalLM`` never calls any of it. PyPI has no CPU torchvision build for
torch 2.13, so the Qwen3.5 runs put this directory on PYTHONPATH. Every name resolves to a
placeholder that can be imported and referenced at module level but raises when called or
instantiated, so a real use cannot pass silently.
"""

import sys
import types

__version__ = "0.0.0+kvconnect-test-stub"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stub (kvconnect test harness): {cls.__qualname__} was called")


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


for _sub in ("io", "ops", "transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional",
             "datasets", "models", "utils"):
    _module = _StubModule(f"{__name__}.{_sub}")
    sys.modules.setdefault(_module.__name__, _module)
    _parent, _, _leaf = _module.__name__.rpartition(".")
    setattr(sys.modules[_parent], _leaf, sys.modules[_module.__name__])


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"{__name__}.{name}")
