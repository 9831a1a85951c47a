#!/usr/bin/env bash
# For .ci/run, after `make test`: the real-server tests when the SGLang environment installs.
# A failed install is reported as SKIPPED with its reason (exit 0), never as a pass; a failed
# test fails the run. Usage: bash tools/sglang_cpu/ci.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
log="$(mktemp)"
if ! bash tools/sglang_cpu/install.sh >"$log" 2>&1; then
    reason="$(grep -v '^WARNING: Location' "$log" | grep -E 'ERROR|Error|error' | tail -1)"
    echo "test-sglang: SKIPPED: the SGLang environment did not install (${reason:-see below})"
    grep -v '^WARNING: Location' "$log" | tail -20
    exit 0
fi
tail -1 "$log"
make test-sglang
