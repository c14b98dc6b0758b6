"""Build support for ``kvconnect._cuda_kernels`` (csrc/cuda_transfer.cu), used by setup.py.

    cuda_ext, cmdclass = cuda_extension_and_cmd(cmdclass)

``KVCONNECT_BUILD_CUDA`` decides (build code only; the library reads the environment in
kvconnect/config.py alone):

| value             | effect |
|-------------------|--------|
| unset / ``auto``  | build when ``nvcc`` is found (``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``), else skip |
| ``1``             | build; fail the install if ``nvcc`` is missing |
| ``0``             | never build (the CPU kernel and the torch path still serve) |

When nvcc is found the build must succeed: CI compiles the kernel (compile-only, no GPU)
so a broken kernel cannot land. The extension links the CUDA runtime statically (symbols
hidden) and no libtorch, so one build works with any torch release; it needs a driver at
least as new as the toolkit it was built with. Machine code for sm_75, sm_80 (also run by
sm_86/89) and sm_90 (those this nvcc supports), plus PTX of the newest for later GPUs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

from setuptools import Extension
from setuptools.command.build_ext import build_ext as _setuptools_build_ext

ENV_VAR = "KVCONNECT_BUILD_CUDA"
# sm_80 machine code also runs on sm_86/sm_89; the sm_90 PTX is JIT-compiled on newer GPUs.
WANTED_ARCHS = ("75", "80", "90")
SOURCE = "csrc/cuda_transfer.cu"


def build_mode() -> str:
    """'auto', 'on' or 'off' from KVCONNECT_BUILD_CUDA."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("1", "true", "yes", "on"):
        return "on"
    if raw in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"{ENV_VAR}={raw!r}: expected 1, 0 or auto")


def find_nvcc() -> Optional[str]:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.isfile(default) else None


def _cuda_lib_dir(nvcc: str) -> Optional[str]:
    """Folder of libcudart_static.a: nvcc may be a wrapper script, so ask nvcc where it lives."""
    roots = []
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                roots.append(line.split("TOP=", 1)[1].strip().strip('"'))
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if os.path.isfile(os.path.join(root, sub, "libcudart_static.a")):
                return os.path.join(root, sub)
    return None


def _gencode_flags(nvcc: str) -> list[str]:
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout.split()
        supported = {a.removeprefix("compute_") for a in listed}
    except (OSError, subprocess.SubprocessError):
        supported = set()
    archs = [a for a in WANTED_ARCHS if a in supported] or ["80", "90"]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX: JIT on newer GPUs
    return flags


def cuda_extension_and_cmd(cmdclass: dict) -> tuple[Optional[Extension], dict]:
    """The CUDA extension and a build_ext that compiles ``.cu`` with nvcc, or (None, cmdclass)."""
    mode = build_mode()
    if mode == "off":
        return None, cmdclass
    nvcc = find_nvcc()
    if nvcc is None:
        if mode == "on":
            raise RuntimeError(f"{ENV_VAR}=1 but nvcc was not found: set CUDA_HOME or put nvcc on PATH")
        return None, cmdclass
    lib_dir = _cuda_lib_dir(nvcc)
    if lib_dir is None:
        raise RuntimeError(f"nvcc found at {nvcc} but not libcudart_static.a; set CUDA_HOME or {ENV_VAR}=0")
    import pybind11

    ext = Extension(
        "kvconnect._cuda_kernels",
        [SOURCE],
        depends=["csrc/copy_plan.h", "csrc/cuda_resources.h", "csrc/staged_plan.h", "csrc/transfer_desc.h"],
        include_dirs=[pybind11.get_include(), "csrc"],
        library_dirs=[lib_dir],
        libraries=["cudart_static", "dl", "rt", "pthread"],
        # Keep the static runtime's symbols private: never bind to (or be bound by) torch's libcudart.
        extra_link_args=["-Wl,--exclude-libs,ALL"],
        language="c++",
    )
    nvcc_flags = ["-O3", "-std=c++17", "--threads", "0", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", *_gencode_flags(nvcc)]
    base = cmdclass.get("build_ext", _setuptools_build_ext)

    class BuildExtWithCuda(base):  # type: ignore[misc, valid-type]
        """build_ext that hands ``.cu`` sources to nvcc and everything else to the C++ compiler."""

        def build_extensions(self) -> None:
            compiler = self.compiler
            if ".cu" not in compiler.src_extensions:
                compiler.src_extensions.append(".cu")
            cxx_compile = compiler._compile

            def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
                if not src.endswith(".cu"):
                    return cxx_compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
                compiler.spawn([nvcc, "-c", src, "-o", obj, *pp_opts, *nvcc_flags])

            compiler._compile = _compile
            try:
                super().build_extensions()
            finally:
                compiler._compile = cxx_compile

    return ext, {**cmdclass, "build_ext": BuildExtWithCuda}
