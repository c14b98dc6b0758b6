"""Builds kvconnect's compiled kernels (pybind11, no libtorch).

- ``kvconnect._cpu_kernels``: always (gcc/clang with OpenMP where available).
- ``kvconnect._cuda_kernels``: when ``nvcc`` is found. ``KVCONNECT_BUILD_CUDA=1`` forces it
  (failing loudly without nvcc), ``KVCONNECT_BUILD_CUDA=0`` skips it, unset means auto.
"""

import os
import subprocess
import sys
import tempfile

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup


def _openmp_flags() -> list[str]:
    """-fopenmp if the compiler accepts it (gcc does; Apple clang does not)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        cc = os.environ.get("CC", "cc")
        ok = subprocess.run([cc, "-fopenmp", src, "-o", os.path.join(tmp, "t")], capture_output=True).returncode == 0
    return ["-fopenmp"] if ok else []


omp = _openmp_flags()
ext_modules = [
    Pybind11Extension(
        "kvconnect._cpu_kernels",
        ["csrc/cpu_transfer.cpp"],
        include_dirs=["csrc"],
        depends=["csrc/copy_plan.h", "csrc/staged_plan.h", "csrc/transfer_desc.h"],
        extra_compile_args=["-O3"] + omp,
        extra_link_args=omp,
        cxx_std=17,
    )
]
cmdclass = {"build_ext": build_ext}

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
try:
    from build_cuda import cuda_extension_and_cmd  # noqa: E402  (present once the CUDA kernel lands)
except ImportError:  # pragma: no cover
    cuda_extension_and_cmd = None
if cuda_extension_and_cmd is not None:
    cuda_ext, cmdclass = cuda_extension_and_cmd(cmdclass)
    if cuda_ext is not None:
        ext_modules.append(cuda_ext)

setup(
    # every package under kvconnect/ (the CLI, the adapters, the tiers), found rather than listed
    packages=find_packages(include=["kvconnect", "kvconnect.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
