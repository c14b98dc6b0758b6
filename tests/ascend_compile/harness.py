"""TEST HARNESS: compile Triton kernels with triton-ascend's real stages on a machine without CANN.

Runs inside the ``.venv-triton-ascend`` venv (.ci/install_triton_ascend.sh: triton-ascend 3.2.0, which
installs as ``triton``, plus ascendnpu-ir 1.2.0's ``bishengir-compile`` / ``bishengir-compile-a5``).
Everything between the Triton source and the final hand-over to CANN is Ascend's own code:
``make_ttir`` -> ``triton-adapter-opt`` (TTIR -> linalg/HIVM) -> ``bishengir-compile`` (HFusion/HIVM
passes) -> ``hivmc``. Two things are stood in for here, and only here (never in the product):

- the SoC query: triton-ascend's ``NPUUtils`` builds a C extension against CANN and asks the driver
  for the SoC name (A2/A3 take it from there for ``--target``). ``_SocName`` returns the name the
  test asks for. The backend module is loaded twice (as ``triton.backends.ascend.compiler`` and as
  ``ascend``), so both module globals are patched.
- ``hivmc`` (CANN's final code generator, not on PyPI): a shell script put first on PATH that answers
  ``--version``, copies the module it is handed (``module.hivm.opt.mlir``, hivmc's input) into a
  directory this harness reads, and writes an empty object so bishengir-compile finishes.

``compile_kernel`` returns the lowered text of every stage: ``ttadapter`` (triton-adapter-opt's
output) and ``hivm`` (hivmc's input). ``inspect`` counts what matters in them: per-lane scalarised
accesses (the ``DiscreteMemAccess`` / ``ExtractedLoadOrStore`` tags triton-adapter-opt puts on the
loops it makes of a gather) and the DMA calls between global memory and the unified buffer.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOCS = {  # generation -> (SoC name bishengir takes, compile_on_910_95)
    "A2": ("Ascend910B3", False),
    "A3": ("Ascend910_9382", False),
    "A5": ("Ascend950PR_9599", True),
}

_HIVMC = """#!/usr/bin/env bash
# TEST HARNESS stand-in for CANN's hivmc: keeps its input module, writes an empty object.
if [ "${1:-}" = "--version" ]; then echo "hivmc 0.0.0 (0000000 2026-01-01)"; exit 0; fi
keep="${KVCONNECT_HIVMC_KEEP:?}"
out=""; prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  case "$a" in *.mlir) cp "$a" "$keep/hivmc-input-$(basename "$a")" ;; esac
  prev="$a"
done
echo "$*" > "$keep/hivmc.args"
[ -n "$out" ] && : > "$out" && : > "$out.o"
exit 0
"""

SCALARISED_TAGS = ("DiscreteMemAccess", "ExtractedLoadOrStore")
_DMA = re.compile(r"call @(load_gm_to_ubuf|store_ubuf_to_gm)\w*|hivm\.hir\.(load|store|copy)\b")


@dataclass(frozen=True)
class Lowered:
    ttadapter: str  # triton-adapter-opt's output (linalg + HIVM annotations)
    hivm: str  # what bishengir-compile hands to hivmc


@dataclass(frozen=True)
class Inspection:
    scalarised: int  # DiscreteMemAccess / ExtractedLoadOrStore tags, both stages together
    dma: int  # GM <-> UB transfer ops in hivmc's input
    scalar_gm_loads: int  # memref.load / memref.store on global memory in hivmc's input


class Toolchain:
    """Set up once per process: the stand-ins on PATH and the SoC patch."""

    def __init__(self, workdir: str) -> None:
        import triton  # triton-ascend
        from triton.backends import backends

        if "ascend" not in backends:
            raise RuntimeError("triton here is not triton-ascend (no 'ascend' backend)")
        self.triton = triton
        self.root = Path(workdir)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        hivmc = self.bin / "hivmc"
        hivmc.write_text(_HIVMC)
        hivmc.chmod(hivmc.stat().st_mode | stat.S_IEXEC)
        a5 = self.bin / "hivmc-a5"  # bishengir-compile-a5 asks for this name
        if not a5.exists():
            a5.symlink_to(hivmc)
        import ascendnpuir

        self.ir_bin = Path(ascendnpuir.__file__).parent / "bin"
        for name in ("bishengir-compile", "bishengir-compile-a5"):
            if not (self.ir_bin / name).exists():
                raise RuntimeError(f"ascendnpu-ir has no {name} at {self.ir_bin}")
        os.environ["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        self._soc = {"name": "Ascend910B3"}
        soc = self._soc

        class _SocName:  # TEST HARNESS stand-in for triton-ascend's NPUUtils (CANN + driver)
            def get_arch(self) -> str:
                return soc["name"]

        import triton.backends.ascend.compiler as compiler_module

        compiler_module.NPUUtils = _SocName
        backends["ascend"].compiler.add_stages.__globals__["NPUUtils"] = _SocName

    def _link_compiler(self, a5: bool) -> None:
        link = self.bin / "bishengir-compile"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(self.ir_bin / ("bishengir-compile-a5" if a5 else "bishengir-compile"))

    def compile_kernel(self, fn, signature: dict, constants: dict, generation: str) -> Lowered:
        """Compile ``fn`` for one SoC generation through every stage to hivmc; raises on a failed stage."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        soc, on_910_95 = SOCS[generation]
        self._soc["name"] = soc
        self._link_compiler(on_910_95)
        keep = Path(tempfile.mkdtemp(prefix=f"hivmc-{generation}-", dir=self.root))
        os.environ["KVCONNECT_HIVMC_KEEP"] = str(keep)
        os.environ["TRITON_CACHE_DIR"] = str(keep / "cache")  # a cached kernel would skip every stage
        options = {}
        if on_910_95:
            options["compile_on_910_95"] = True
        src = ASTSource(fn, signature, constants=constants)
        kernel = self.triton.compile(src, target=GPUTarget("npu", soc, 0), options=options)
        hivm_files = sorted(keep.glob("hivmc-input-*.mlir"))
        if not hivm_files:
            raise RuntimeError(f"bishengir-compile never called hivmc for {fn.__name__} on {generation}")
        lowered = Lowered(ttadapter=kernel.asm["ttadapter"], hivm="\n".join(p.read_text() for p in hivm_files))
        shutil.rmtree(keep, ignore_errors=True)
        return lowered


def inspect(lowered: Lowered) -> Inspection:
    both = lowered.ttadapter + lowered.hivm
    scalarised = sum(both.count(tag) for tag in SCALARISED_TAGS)
    dma = len(_DMA.findall(lowered.hivm))
    gm_scalar = sum(1 for line in lowered.hivm.splitlines()
                    if re.search(r"memref\.(load|store)\b", line) and "address_space<gm>" in line)
    return Inspection(scalarised=scalarised, dma=dma, scalar_gm_loads=gm_scalar)


def load_kernels(path: str):
    """triton_kernels.py by path (kvconnect's package imports torch, which this venv lacks)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvconnect_triton_kernels_ascend", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
