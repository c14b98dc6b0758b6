"""csrc/build_cuda.py: the KVCONNECT_BUILD_CUDA switch and the no-nvcc paths (no GPU, no nvcc needed)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _build_cuda_module():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "build_cuda.py")
    spec = importlib.util.spec_from_file_location("kvconnect_build_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_switch(monkeypatch):
    build = _build_cuda_module()
    for raw, mode in [("", "auto"), ("auto", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"), ("false", "off")]:
        monkeypatch.setenv("KVCONNECT_BUILD_CUDA", raw)
        assert build.build_mode() == mode
    monkeypatch.setenv("KVCONNECT_BUILD_CUDA", "maybe")
    with pytest.raises(ValueError, match="KVCONNECT_BUILD_CUDA"):
        build.build_mode()
    cmdclass = {"build_ext": object}
    monkeypatch.setenv("KVCONNECT_BUILD_CUDA", "0")
    assert build.cuda_extension_and_cmd(cmdclass) == (None, cmdclass)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    monkeypatch.setenv("KVCONNECT_BUILD_CUDA", "1")
    with pytest.raises(RuntimeError, match="nvcc was not found"):
        build.cuda_extension_and_cmd(cmdclass)
    monkeypatch.delenv("KVCONNECT_BUILD_CUDA")
    assert build.cuda_extension_and_cmd(cmdclass) == (None, cmdclass)


def test_with_nvcc_the_extension_is_built_by_a_build_ext_that_sends_cu_to_nvcc(monkeypatch):
    build = _build_cuda_module()
    if build.find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    from setuptools.command.build_ext import build_ext

    monkeypatch.delenv("KVCONNECT_BUILD_CUDA", raising=False)
    ext, cmdclass = build.cuda_extension_and_cmd({"build_ext": build_ext})
    assert ext.name == "kvconnect._cuda_kernels" and ext.sources == ["csrc/cuda_transfer.cu"]
    assert "cudart_static" in ext.libraries and "-Wl,--exclude-libs,ALL" in ext.extra_link_args
    assert issubclass(cmdclass["build_ext"], build_ext) and cmdclass["build_ext"] is not build_ext
    flags = build._gencode_flags(build.find_nvcc())
    assert any("code=sm_80" in f for f in flags) and any(f.endswith("code=compute_90") for f in flags)
