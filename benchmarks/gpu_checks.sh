#!/usr/bin/env bash
# The GPU checks of the memory issues, as one command for a device lease (at most 9.5 minutes on
# an H100; each part has its own time limit, so a slow part cannot starve the others).
#
#   device run: bash benchmarks/gpu_checks.sh        (carry .whl: a highspy wheel for the
#                                                    machine's Python; its image has torch
#                                                    and transformers, no package index)
#
# Everything it prints goes to $OUT (default /tmp/gpu_checks), one log per part; the
# pages under docs/results/ are written only by a full run of each benchmark, by hand.
set -u
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps .whl/*.whl > "$out/setup.log" 2>&1
python3 - >> "$out/setup.log" 2>&1 <<'EOF'
import highspy, torch, transformers
print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/setup.log" 2>&1

part() {  # part NAME SECONDS COMMAND...: one check, its log, its exit status and time
    local name=$1 limit=$2 started
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $(($(date +%s) - started)) s" | tee -a "$out/summary.txt"
}

# Issue "The budget, as the GPU counts it": budget vs predicted vs allocator, 1 B Llama.
part memory_truth 180 python3 benchmarks/memory_truth.py --device cuda --quick \
    --settings bf16-mixed:adamw
# The CUDA-marked tests (offload and train hold their budgets on an HF Llama in bf16).
part pytest_cuda 100 python3 -m pytest -q -m cuda tests -p no:cacheprovider
# Issue "Real loops have batches of every length": the padded loop at the H200 table's sizes
# (its first plan's seconds: the issue asks for 2 at most); writes offload_shapes_cuda.md.
part offload_shapes 120 python3 benchmarks/offload_shapes.py --device cuda --hidden 2048 \
    --layers 16 --vocab 32000 --batch 8 --low 1024 --high 2048 --steps 10 --multiple 64 \
    --ways "plain,offload + plan_for,offload"
cp docs/results/offload_shapes_cuda.md "$out/" 2>/dev/null
# Issue "Faster than checkpointing": every peer and pipeswap's budgets, one process each.
part memory_frontier 150 python3 benchmarks/memory_frontier.py --device cuda --hidden 2048 \
    --layers 16 --vocab 32000 --batch 8 --seq 2048 --steps 4 --metered 1 \
    --out "$out/memory_frontier_cuda.md"
cat "$out/summary.txt"
