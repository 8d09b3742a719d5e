#!/usr/bin/env bash
# tests/gpu in one run on a GPU machine that has torch (CUDA) and asyncrl's other dependencies but no megatron-core
# and no network: megatron-core 0.16.1 installs from the wheel carried in the tree, then tests/gpu runs under a time
# limit (default 480 s). Prepare the wheel where there is a network (`make gpu-wheels`: `pip download
# megatron-core==0.16.1 --no-deps -d .wheels`, 2.6 MB, gitignored) and carry `.wheels` with the tree.
#
#   deploy/gpu_check.sh [pytest args ...]      (PYTHON=... picks the interpreter; GPU_CHECK_TIMEOUT_S the limit)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=.wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    wheel=$(ls "$WHEELS"/megatron_core-0.16.1-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        echo "gpu_check: megatron-core is not installed and $WHEELS/ has no megatron_core-0.16.1 wheel (make gpu-wheels)" >&2
        exit 2
    fi
    "$PYTHON" -m pip install --quiet --no-deps --no-index "$wheel"
fi
"$PYTHON" -c "import torch, megatron.core; print('gpu_check: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'megatron-core', megatron.core.__version__)"
exec timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=10 tests/gpu "$@"
