#!/usr/bin/env bash
# The noise-measurement benches on one CUDA GPU in bf16: the per-step cost of each method
# (`gnsweep bench noise`) and what a short run pays with the default measurement and each
# method over the same run with measurement off (`gnsweep bench sweep_cost`). On a GPU, ops
# queue asynchronously (the timings wait for the queue), so the ratios differ from a CPU's.
#
#   scripts/gpu_bench.sh [OUT_DIR]      (OUT_DIR default: bench-gpu; PYTHON to choose python)
#
# Writes OUT_DIR/noise.txt, OUT_DIR/sweep_cost.txt and OUT_DIR/sweep_cost.json.
set -euo pipefail
out="${1:-bench-gpu}"
python="${PYTHON:-python}"
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"   # one GPU
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
"$python" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
"$python" -m gnsweep.bench noise --device cuda --precision bf16 --no-ddp --quick \
    --batch-sizes 32,128,512,2048 2>&1 | tee "$out/noise.txt"
"$python" -m gnsweep.bench sweep_cost --device cuda --precision bf16 \
    --models mlp,cnn,gpt2,lm512,lm4096 --steps 100 --rounds 3 --json "$out/sweep_cost.json" \
    2>&1 | tee "$out/sweep_cost.txt"
