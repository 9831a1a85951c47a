#!/usr/bin/env bash
# Installs the real SGLang 0.5.23 server, CPU-only, into an ignored folder (default .sglang-venv).
# Idempotent: a stamp file marks a finished install; a failed one leaves no stamp and exits non-zero
# (run it again to resume). About 2.6 GB and 2 minutes from the machine's local wheels and PyPI.
# What it works around, and why: docs/REAL_SGLANG.md.
# torch is pinned to the local CPU wheel by a constraints file, so nothing swaps in a CUDA build;
# sglang comes with --no-deps (its declared deps pull CUDA torch, flashinfer, nvidia packages).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$(realpath -m "${SGLANG_VENV:-$HERE/../../.sglang-venv}")"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed-sglang-0.5.23"
if [[ -f "$STAMP" ]]; then
    "$VENV/bin/python" "$HERE/patch_env.py" >/dev/null  # cheap: keeps the workarounds current
    echo "sglang environment ready: $VENV"
    exit 0
fi
started=$(date +%s)
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
CONSTRAINTS="$HERE/constraints.txt"  # every version pinned, torch to the local CPU build
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -c "$CONSTRAINTS" "torch==2.13.0"
"${PIP[@]}" -c "$CONSTRAINTS" --no-deps "sglang==0.5.23"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$HERE/requirements.txt"
# The stand-ins for what PyPI lacks or ships only for CUDA (see support/ in this folder).
"$VENV/bin/python" "$HERE/patch_env.py"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "import torch, torchvision, sglang, sglang.srt.entrypoints.http_server; assert not torch.version.cuda, torch.version.cuda; print('sglang', sglang.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "sglang environment installed in $(( $(date +%s) - started )) s: $VENV"
