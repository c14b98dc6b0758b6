# Sourced by the engine install scripts: a venv cached outside the checkout, keyed by its recipe.
#
#   use_cached_venv .venv-vllm "$0"      # sets VENV (and PY) and links .venv-vllm to it
#   ...install into "$VENV" unless venv_complete...
#   mark_venv_complete
#
# The venv lives in $KVCONNECT_CI_CACHE (default ~/.cache/kvconnect-ci)/venv-<name>-<key>, where
# <key> hashes the install script, .ci/cpu_torch.sh and this file: a changed recipe builds a new
# venv (a cold cache, as on a fresh machine) and the venvs of older recipes of the same name are
# removed. The link in the checkout is what tests and .ci/run name (.venv-vllm/bin/python). A
# venv counts as built only once its script marked it complete, so an install cut short is
# built again. kvconnect itself is (re)installed editable into it by each run of the script,
# from the checkout that runs it.
CACHE=${KVCONNECT_CI_CACHE:-$HOME/.cache/kvconnect-ci}

use_cached_venv() {  # LINK SCRIPT
    local link=$1 script=$2 name key
    name=${link#.venv-}
    key=$(cat ".ci/$(basename "$script")" .ci/cpu_torch.sh .ci/venv_cache.sh | sha256sum | cut -c1-12)
    VENV="$CACHE/venv-$name-$key"
    PY="$VENV/bin/python"
    mkdir -p "$CACHE"
    local old
    for old in "$CACHE/venv-$name-"*; do
        [ "$old" = "$VENV" ] || [ ! -d "$old" ] || { echo "venv cache: removing $old (an older recipe)"; rm -rf "$old"; }
    done
    if [ ! -f "$VENV/.complete" ]; then
        echo "venv cache: building $VENV (cold)"
        rm -rf "$VENV"
        python3 -m venv "$VENV"
    else
        echo "venv cache: reusing $VENV"
    fi
    # a link of an older key, or a venv made in the checkout before caching: replaced by the link
    if [ -L "$link" ] || [ -e "$link" ]; then rm -rf "$link"; fi
    ln -s "$VENV" "$link"
}

venv_complete() { [ -f "$VENV/.complete" ]; }

mark_venv_complete() { touch "$VENV/.complete"; }
