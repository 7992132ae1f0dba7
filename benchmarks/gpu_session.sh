#!/usr/bin/env bash
# A lent GPU's whole check in one command (docs/BENCHMARKS.md "GPU (H200)"): the device tool runs this on the GPU
# machine, which has torch and Triton but no package registry.
#
#   here, once:       make gpu-wheels        # fla-core 0.6.0 + transformers 5.23.0 as cp312 wheels in .whl/ (ignored)
#   device tool:      run  command="bash benchmarks/gpu_session.sh 360"  carry=[".whl"]  timeout_s=420
#
# Installs the carried wheels (if .whl/, or $WHEELS, has any) into /tmp/site, records the machine and the versions, runs
# benchmarks/gpu_check.py with a whole-run budget of $1 seconds (default 360: with the machine's start, a rerun still
# fits a session's 15 device minutes), section a with a budget of $A_S seconds (default 150) and the longest-prompt
# search with $LONGEST_S per mode (default 40); any further arguments go to gpu_check.py. gpu_check.json (rewritten
# after every part, so a kill keeps what was measured) and gpu_check.log land in $OUT (the device tool's folder that
# comes back), or in ./gpu_out where OUT is unset.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:-360}
[ $# -gt 0 ] && shift
out=${OUT:-gpu_out}
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
        || { echo "gpu_session: installing the carried wheels failed" | tee "$log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    echo "gpu_session: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not on this machine"
    fi
    python3 - <<'EOF'
import importlib
for name in ("torch", "triton", "fla", "transformers", "peft"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # reported, not fatal: gpu_check says what each missing package costs
        print(f"{name}: not importable ({type(e).__name__}: {e})")
EOF
} 2>&1 | tee "$log"
python3 benchmarks/gpu_check.py --json "$out/gpu_check.json" --budget-s "$budget" --a-s "${A_S:-150}" \
    --longest-s "${LONGEST_S:-40}" "$@" 2>&1 | tee -a "$log"
