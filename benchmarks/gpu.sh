#!/usr/bin/env bash
# The GPU suite, one command on a machine with a CUDA GPU: in about 8 minutes on one GPU,
#
#   1. a virtual environment (.venv-gpu, or $VENV) with torch 2.13 as PyPI serves it (its CUDA build, with the
#      Triton it was built with) and this package with its fla and triton extras, at constraints.txt's versions;
#   2. the kernel tests on the GPU: the two-phase kernels (tests/test_triton_kernels.py, compiled Triton, not the
#      interpreter) and fla's fused read (tests/test_fla_kernel.py's CUDA tests);
#   3. benchmarks/overhead.py --device cuda: train / prefill / decode / memory ratios to Llama for Block and Full,
#      eager with torch, with fla's fused read (+fla) and with the two-phase kernels (+triton); regionally compiled
#      (train, prefill) with compile times; and decode compiled whole with a static cache under CUDA graphs. The
#      tables go to docs/results/overhead_cuda.md and the verdicts into the README's GPU block.
#
#   bash benchmarks/gpu.sh                      # the suite
#   bash benchmarks/gpu.sh --repeats 8          # extra options go to overhead.py
#   VENV=/path/to/env bash benchmarks/gpu.sh    # an environment of your own (installed into when incomplete)
#
# No GPU has run it yet (README: "Speed"); its time is estimated from the CPU runs' structure.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "benchmarks/gpu.sh needs a CUDA GPU: nvidia-smi lists none (on a CPU: make bench; a quick check: python benchmarks/overhead.py --smoke)" >&2
  exit 1
fi
VENV=${VENV:-.venv-gpu}
PY="$VENV/bin/python"
test -x "$PY" || "${PYTHON:-python3}" -m venv "$VENV"
if ! "$PY" -c "import torch, triton, fla, pytest, attnres_hf; assert torch.cuda.is_available()" 2> /dev/null; then
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet torch==2.13.0  # PyPI's wheel is the CUDA build; it pins its own Triton
  # constraints.txt pins the CPU machines' torch and Triton: the GPU's are the wheel's
  grep -v -E '^(torch|triton)==' constraints.txt > "$VENV/constraints-gpu.txt"
  "$PY" -m pip install --quiet -c "$VENV/constraints-gpu.txt" -e ".[fla,triton,train]" pytest
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name())"

"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fla_kernel.py

"$PY" benchmarks/overhead.py --device cuda --quick --knobs none --fla --triton \
  --modes eager,regional,compiled --compiled-workloads decode \
  --results docs/results/overhead_cuda.md --readme "$@"
