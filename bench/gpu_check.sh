#!/usr/bin/env bash
# Run this first on a new GPU machine: what the CPU tests cannot see (CUDA's and NCCL's own rules), one
# PASS or FAIL line per check, on one GPU. Tiny models and clips are built in a temporary folder, which
# keeps every check's log; nothing else is written.
#
#   bash bench/gpu_check.sh          all checks (on a machine without CUDA: the ones a CPU can run)
#   bash bench/gpu_check.sh --cpu    the CPU checks only, to check the script itself
#
# 1. host syncs: CUDA's sync debug mode set to "error" over the non-log steps of each family
#    (tests/test_host_syncs.py; on a CPU its dispatch-mode count instead)
# 2. the attention kernel SDPA picks at every shipped config's sequence length (GPU only)
# 3. the tiny trainer in bf16, 1 process: DDP, FSDP, FSDP with cpu_offload (every block streamed; and
#    block 0 alone with activation offload), each with async save, validation and export
# 4. train.compile, its recompiles counted with TORCH_LOGS=recompiles (under the limit, model.py)
# 5. run.deterministic: one attention forward and backward at CogVideoX-5B's sequence length
# 6. bench/bench_gpu.py (--smoke on a CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [[ "${1:-}" == "--cpu" ]] || ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    device=cpu
fi
cpu_flag=$([[ $device == cpu ]] && echo --cpu)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
failed=0

check() {  # check NAME COMMAND...: PASS or FAIL with the log's path; the command's output goes to the log
    local name=$1 log="$tmp/$1.log"
    shift
    if "$@" > "$log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (log: $log)"; failed=1; fi
}

passes() {  # passes NAME COMMAND...: for commands printing PASS/FAIL lines of their own
    local log="$tmp/$1.log"
    shift
    "$@" > "$log" 2>&1 || failed=1
    grep -E "^(PASS|FAIL)" "$log" || { echo "FAIL $1 (log: $log)"; failed=1; }
}

python tools/make_tiny_model.py --out "$tmp/model" > "$tmp/setup.log" 2>&1 &&
    python tools/make_synthetic_dataset.py --out "$tmp/data" --num-videos 12 >> "$tmp/setup.log" 2>&1 ||
    { echo "FAIL setup (log: $tmp/setup.log)"; exit 1; }

syncs=$([[ $device == cuda ]] && echo "on_a_gpu" || echo "not on_a_gpu")
check "host-syncs-$device" python -m pytest -q -p no:cacheprovider tests/test_host_syncs.py -k "$syncs"
[[ $device == cuda ]] && passes attention-kernels python bench/attention_check.py kernels

tiny=(configs/tiny.toml --model.path "$tmp/model" --data.data_root "$tmp/data" --data.cache_dir "$tmp/cache"
      --model.dtype bf16 --train.mixed_precision bf16 --train.steps 8 --train.log_every 4
      --checkpoint.checkpointing_steps 4 --checkpoint.async_save true --validation.validation_steps 8
      --validation.num_inference_steps 4)
exported() {  # exported NAME OVERRIDES...: the run ends 0 with its LoRA written
    local out="$tmp/$1"
    shift
    NPROC=1 bash launch.sh "${tiny[@]}" --run.output_dir "$out" "$@" && test -f "$out/lora/pytorch_lora_weights.safetensors"
}
check tiny-ddp exported ddp --parallel.strategy ddp
check tiny-fsdp exported fsdp --parallel.strategy fsdp
check tiny-fsdp-cpu-offload exported offload --parallel.strategy fsdp --parallel.cpu_offload true
check tiny-streaming exported streaming --parallel.strategy fsdp --parallel.cpu_offload true --parallel.offload_blocks 1 \
    --train.gradient_checkpointing true --train.activation_offload true

compiled() {  # the compiled run ends 0 without reaching dynamo's recompile limit
    TORCH_LOGS=recompiles exported compile --train.compile true --train.gradient_checkpointing true &&
        ! grep -q "recompile_limit" "$tmp/train-compile.log"
}
check train-compile compiled
echo "     $(grep -c "Recompiling function" "$tmp/train-compile.log") recompiles of the compiled blocks"

passes deterministic python bench/attention_check.py deterministic $cpu_flag

benched() {  # every configuration ran (one out of memory is a result, not a failure)
    python bench/bench_gpu.py $([[ $device == cpu ]] && echo --smoke) && ! grep -q " failed:" "$tmp/bench-gpu.log"
}
check bench-gpu benched
cat "$tmp/bench-gpu.log"
echo "logs in $tmp"
exit $failed
