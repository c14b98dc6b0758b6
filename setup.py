"""Builds kvconnect's compiled kernels (pybind11, no libtorch).

- ``kvconnect._cpu_kernels``: always (gcc/clang with OpenMP where available).
- ``kvconnect._cuda_kernels``: when ``nvcc`` is found. ``KVCONNECT_BUILD_CUDA=1`` forces it
  (failing loudly without nvcc), ``KVCONNECT_BUILD_CUDA=0`` skips it, unset means auto.

An extension already built in place (``kvconnect/<name>.<abi tag>.so``, by ``build_ext --inplace``
or an editable install) that is newer than every file it is built from is copied rather than
compiled again: the ABI tag in its name ties it to this interpreter, and one checkout's several
venvs (the core one and each engine's, all of one Python) then compile the kernels once, not
once per install.
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

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INPUTS = ("setup.py", "csrc/build_cuda.py", "pyproject.toml")  # what decides how any kernel is built


def _with_inplace_reuse(base):
    class BuildExtReusingInplace(base):  # type: ignore[misc, valid-type]
        """build_ext that takes an up-to-date in-place build of an extension instead of compiling it."""

        def build_extension(self, ext) -> None:
            target = self.get_ext_fullpath(ext.name)
            built = os.path.join(HERE, self.get_ext_filename(self.get_ext_fullname(ext.name)))
            inputs = [os.path.join(HERE, f) for f in (*ext.sources, *ext.depends, *BUILD_INPUTS)]
            if (os.path.abspath(target) != built and os.path.isfile(built)
                    and all(os.path.getmtime(built) >= os.path.getmtime(f) for f in inputs if os.path.exists(f))):
                self.mkpath(os.path.dirname(target))
                self.copy_file(built, target)
                print(f"{ext.name}: up-to-date in-place build {os.path.relpath(built, HERE)} reused")
                return
            super().build_extension(ext)

    return BuildExtReusingInplace


cmdclass["build_ext"] = _with_inplace_reuse(cmdclass["build_ext"])

setup(
    # every package under kvconnect/ (the CLI, the adapters, the tiers), found rather than listed
    packages=find_packages(include=["kvconnect", "kvconnect.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
