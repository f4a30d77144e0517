#!/usr/bin/env bash
# torchrun wrapper.
#
#   bash launch.sh                          the demo: tiny CogVideoX, generated clips, 2 CPU processes
#   bash launch.sh FILE.toml [overrides]    train; NPROC, NNODES, NODE_RANK, RDZV_ENDPOINT from the
#                                           environment, or from SLURM when run inside a SLURM job
#
# Logs are filtered to local rank 0 (LOG_RANKS to change it; "" shows every rank). SIGTERM and SIGUSR1
# (SLURM's warning before a time limit) reach the workers, which save and exit 0; torchrun gives them
# SHUTDOWN_TIMEOUT seconds (default 600, torchrun's own is 30) before it kills them: set it longer than
# your longest checkpoint save. The exit code is the workers' (0 after such a stop, 130 after Ctrl-C).
# After a failure our one error line is printed last; torchrun's own report of it (the traceback and
# "ChildFailedError" block it prints on every failure) is kept in run.output_dir/torchrun.log instead.
#
# A collective on GPU tensors that outlasts parallel.timeout_s raises nothing in Python: NCCL's watchdog
# aborts the process (SIGABRT). With TORCH_NCCL_DUMP_ON_TIMEOUT=1 (set here unless you set it) it first
# writes each rank's last collectives (the flight recorder's TORCH_FR_BUFFER_SIZE entries) to
# /tmp/nccl_trace_rank_<rank> (TORCH_FR_DUMP_TEMP_FILE); `torchfrtrace` finds the rank that stopped.
set -euo pipefail
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
cd "$(dirname "$0")"

if [[ $# -eq 0 ]]; then
    [[ -f runs/tiny-model/model_index.json ]] || python tools/make_tiny_model.py --out runs/tiny-model
    [[ -f runs/tiny-data/prompts.txt ]] || python tools/make_synthetic_dataset.py --out runs/tiny-data --num-videos 32
    NPROC=${NPROC:-2} bash "$0" configs/tiny.toml
    echo "LoRA:        runs/tiny/lora/pytorch_lora_weights.safetensors"
    echo "clips:       runs/tiny/validation_res/"
    echo "TensorBoard: tensorboard --logdir runs/tiny/logs"
    exit 0
fi

config=$1
shift
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # One launcher per node (srun --ntasks-per-node 1); the first node of the allocation hosts the rendezvous.
    NNODES=${NNODES:-$SLURM_NNODES}
    NODE_RANK=${NODE_RANK:-$SLURM_NODEID}
    RDZV_ENDPOINT=${RDZV_ENDPOINT:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500}
    NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-1}}
fi
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
NNODES=${NNODES:-1}

args=(--nproc_per_node "$NPROC" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
      --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}")
if [[ -n "${LOG_RANKS-0}" ]]; then
    args+=(--local-ranks-filter "${LOG_RANKS-0}")
fi
if [[ "$NNODES" -gt 1 ]]; then
    : "${RDZV_ENDPOINT:?multi-node runs need RDZV_ENDPOINT=host:port of node 0}"
    args+=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?multi-node runs need NODE_RANK}"
           --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-vidtrain}")
else
    args+=(--standalone)
fi
# The allocator settings (expandable segments, exact-size pinned host memory) are set by each worker
# itself (ranks.init), however it was launched; a key of your PYTORCH_ALLOC_CONF keeps your value.
# torchrun exits 1 after passing on a signal it got itself (Ctrl-C; a scheduler that signals every
# process of the job), however the workers ended: each worker writes its own exit code here instead, rank 0
# its one-line error (error) and run.output_dir (output_dir).
exit_codes=$(mktemp -d)
trap 'rm -rf "$exit_codes"' EXIT
# torchrun's stderr, whole, goes to a log; the user sees it as it comes but for torchrun's own lines (its
# logger's, and the traceback and failure block it prints as it exits), which are held back. Read line by
# line in bash: awk would read the pipe in blocks and hold the live output back with it.
log=$(mktemp "${TMPDIR:-/tmp}/vidtrain-torchrun.XXXXXX")
mkfifo "$exit_codes/stderr"
torchrun_line='^[IWEF][0-9]{4} [0-9:.]+ +[0-9]+ .*torch/distributed/'
hold() {
    local line failing=0 exiting=0
    while IFS= read -r line || [[ -n "$line" ]]; do
        printf '%s\n' "$line" >> "$log"
        if [[ $line =~ $torchrun_line ]]; then
            [[ $line == *"failed (exitcode"* ]] && failing=1
        elif [[ $failing == 1 && $line == "Traceback (most recent call last):" ]]; then
            exiting=1
        elif [[ $exiting == 0 ]]; then
            printf '%s\n' "$line" >&2
            continue
        fi
        printf '%s\n' "$line" >> "$exit_codes/held"
    done
}
# The filter ignores the signals a terminal or a scheduler sends the whole job: it must outlive torchrun.
(trap '' INT TERM USR1 HUP; hold) < "$exit_codes/stderr" &
filter=$!
VIDTRAIN_EXIT_CODES=$exit_codes python -m torch.distributed.run "${args[@]}" trainer.py --cfg "$config" "$@" \
    2> "$exit_codes/stderr" &
torchrun=$!
# A signal sent to this script goes to the workers themselves: torchrun may have had it already (a
# second one would cut short its wait for them), and the workers take it twice without harm. Before
# they exist, torchrun gets it. Ctrl-C reaches torchrun from the terminal, which passes it on.
forward() { pkill "-$1" -P "$torchrun" || kill "-$1" "$torchrun" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap ':' INT
while true; do
    status=0
    wait "$torchrun" || status=$?
    kill -0 "$torchrun" 2>/dev/null || break  # still running: a signal only interrupted the wait
done
wait "$filter" || true
if [[ -s "$exit_codes/error" ]]; then
    # Our one line says what failed and what to do: it comes last, torchrun's own report goes to its log.
    if [[ -s "$exit_codes/output_dir" && -d "$(cat "$exit_codes/output_dir")" ]]; then
        kept="$(cat "$exit_codes/output_dir")/torchrun.log"
        cat "$log" >> "$kept" && rm -f "$log"
    else
        kept=$log
    fi
    echo "torchrun's own report: $kept" >&2
    cat "$exit_codes/error" >&2
else
    [[ -f "$exit_codes/held" ]] && cat "$exit_codes/held" >&2  # no line of ours: torchrun's report is the news
    rm -f "$log"
fi
shopt -s nullglob
codes=("$exit_codes"/rank-*)
if [[ ${#codes[@]} -eq $NPROC && $(sort -u "${codes[@]}" | wc -l) -eq 1 ]]; then
    exit "$(cat "${codes[0]}")"  # every worker ended alike
fi
exit "$status"
