"""vidtrain: fine-tune a video diffusion transformer with LoRA or full fine-tuning.

    torchrun --nproc_per_node N trainer.py --cfg FILE.toml [--section.key value ...]
    python trainer.py --cfg FILE.toml [--section.key value ...]

Build order: frozen weights, LoRA, activation checkpointing, DDP or fully_shard, then the optimizer
over the trainable parameters only. The loop: micro-steps, clip, step, then save, then validate.
"""

import argparse
import contextlib
import logging
import math
import sys
from pathlib import Path

import torch

import cache
import ckpt
import command
import data
import faults
import lora
import memory
import parallel
import ranks
import validate
from cache import Prefetch
from config import Config, ConfigError, TrainConfig, to_toml
from data import Sampler, micro_slice
from metrics import Metrics, TrainWindow
from model import EMA, LossScaler, ProdigyCounters, build_frozen, build_model, build_optimizer, setup_adapter

log = logging.getLogger("vidtrain")


def train(cfg: Config, d: ranks.Dist) -> None:
    """One run: the adapter, the data, the model, the optimizer, the checkpoints, the loop, export."""
    t = cfg.train
    # The adapter, then the data: the model checked before any clip, every clip before any compute.
    ranks.check_shared(cfg.run.output_dir, "run.output_dir", d)
    adapter = setup_adapter(cfg, d)
    entries, train_clips, held_out_clips = cache.prepare(cfg, adapter, d)
    renderer = (
        validate.ClipRenderer(
            adapter,
            cfg.validation,
            cfg.data,
            cfg.run.output_dir,
            d,
            lambda folder: build_frozen(adapter, folder, t, cfg.parallel, d),
        )
        if cfg.validation.do_validation
        else None
    )
    global_batch = t.batch_size * t.gradient_accumulation_steps * d.dp_world
    sampler = Sampler([item.bucket for item in train_clips], global_batch, cfg.run.seed)

    # The model and its optimizer.
    model = build_model(adapter, t, cfg.lora, cfg.parallel, cfg.run.seed, d)
    params, optimizer = build_optimizer(model, t, cfg.lora.plus_ratio if t.training_type == "lora" else 0.0)
    state, scaler = TrainState(d.device), LossScaler(d.device, enabled=t.mixed_precision == "fp16")
    ema = EMA(model, t.ema_decay) if t.ema_decay else None
    objects = {"model": model, "optimizer": optimizer, "sampler": sampler, "train": state}
    objects |= {"ema": ema} if ema is not None else {}
    objects |= {"scaler": scaler} if scaler.enabled else {}
    objects |= {"prodigy": ProdigyCounters(optimizer)} if t.optimizer == "prodigy" else {}

    # The checkpoints: the newest one resumed, the resolved config written.
    checkpoints = ckpt.Checkpointer(
        cfg.checkpoint,
        cfg.run.output_dir,
        d,
        ckpt.run_identity(adapter, cfg.model, cfg.train, cfg.lora),
        ckpt.data_identity(train_clips, cfg.data.target_fps, adapter.trains_sound),
    )
    resumed = checkpoints.resume(objects)
    if state.step > t.steps:
        raise ConfigError(
            f"{resumed} is at step {state.step}, past train.steps = {t.steps}: set train.steps to "
            f"{state.step} or more to continue (equal: the run is finished, it exports), or choose "
            "another run.output_dir"
        )
    if d.is_main:
        name = f"config-resume-{state.step}.toml" if state.step else "config.toml"
        (Path(cfg.run.output_dir) / name).write_text(to_toml(cfg))
    log.info(
        "global batch %d = %d per rank x %d accumulation x %d data-parallel ranks; %d training clips, "
        "%d held out",
        global_batch,
        t.batch_size,
        t.gradient_accumulation_steps,
        d.dp_world,
        len(train_clips),
        len(held_out_clips),
    )

    # The loop.
    metrics = Metrics(cfg.run.output_dir, d.is_main, state.step, t.steps)
    compute = parallel.Compute(d.device, t.mixed_precision, t.attention_backend)

    def run_validation(step: int) -> bool:
        """Held-out loss and clips, with the EMA weights swapped in when EMA is on; False when a
        stop signal cut it short (every rank agrees, between sampling steps). Eager under
        train.compile (validate.eager)."""
        memory.reset_peak_memory(d.device)  # val/peak_mem_gb is the validation's own
        try:
            with ema.swapped_in() if ema is not None else contextlib.nullcontext(), validate.eager():
                values = validate.held_out_loss(
                    adapter, model, entries, held_out_clips, cfg.validation, cfg.run.seed, d, compute
                )
                values |= renderer.run(model, step, metrics, compute)
        except ranks.Preempted:
            return False
        # sampling's and decoding's blocks back to training's (no-op without CUDA)
        torch.cuda.empty_cache()
        metrics.scalars(step, values)
        metrics.progress_validation(step, values)
        return True

    # The validation of the start: before step 1, or the resumed step's when a stop cut it short.
    pending = state.validation_pending and not ranks.broadcast(metrics.logged_validation(state.step), d)
    if cfg.validation.do_validation and (state.step == 0 or pending):
        if not run_validation(state.step):
            raise ranks.Preempted(
                f"during the validation of step {state.step}, with nothing new to save; launch "
                "again to run it"
            )
    window, stop = TrainWindow(d, global_batch, state.step, adapter.LOSS_PARTS), False
    prefetch = Prefetch(entries, d.device)

    for step in range(state.step + 1, t.steps + 1):
        batch_ids = sampler.next_batch()
        optimizer.set_lr(lr_factor(step, t))
        step_loss = torch.zeros((), device=d.device)
        for micro in range(t.gradient_accumulation_steps):
            positions = micro_slice(micro, d.dp_rank, d.dp_world, t.batch_size)
            batch = prefetch.batch(
                [train_clips[batch_ids[p]] for p in positions],
                following_clips(train_clips, sampler, batch_ids, step, micro, t, d),
            )
            generators = [data.keyed_generator(cfg.run.seed, step, p) for p in positions]
            if cfg.lora.dropout:
                lora.set_dropout_generator(
                    model, data.keyed_generator(cfg.run.seed, step, "dropout", d.rank, micro, device=d.device)
                )
            with parallel.grad_sync(model, micro == t.gradient_accumulation_steps - 1), compute:
                loss = adapter.train_loss(model, batch, generators).mean()
            if adapter.LOSS_PARTS:
                window.add_parts(adapter.losses)
            loss = faults.on_loss(loss, step)
            # activation checkpointing recomputes the forward in the backward
            with compute.attention():
                scaler.scaled(loss / t.gradient_accumulation_steps).backward()
            step_loss += loss.detach() / t.gradient_accumulation_steps
        grad_norm, skipped = clip_and_step(
            params,
            optimizer,
            scaler,
            t,
            state,
            step,
            step_loss,
            zero_missing=adapter.GRAPH_VARIES and adapter.trains_sound,
        )
        window.add_step(step_loss, skipped)
        if ema is not None:
            ema.update()

        log_now = step % t.log_every == 0 or step == t.steps
        stop = ranks.PREEMPTION.agreed_a_step_late(start_next=step < t.steps)
        save_now = stop or step % cfg.checkpoint.checkpointing_steps == 0 or step == t.steps
        state.validation_pending = cfg.validation.do_validation and (
            step % cfg.validation.validation_steps == 0 or step == t.steps
        )
        validate_now = state.validation_pending and not stop
        if log_now:
            values = window.flush(step, grad_norm, model, optimizer, scaler)
            metrics.scalars(step, values)
            metrics.progress(step, values)
        if log_now or save_now or validate_now:  # where the host waits anyway
            state.check_nonfinite(step, t.max_nonfinite_steps)
        if save_now:
            checkpoints.save(step, objects, final=stop or step == t.steps)
        if validate_now:
            with window.paused():
                stop = not run_validation(step)
        if stop:
            # nothing to do when this step is committed already
            checkpoints.save(step, objects, final=True)
            break

    # The export, once the last step and its validation are done.
    prefetch.close()
    metrics.close()
    # the export waits for the last validation
    if stop and state.step == t.steps and state.validation_pending:
        raise ranks.Preempted(
            f"after the last step ({state.step}), before its validation completed; checkpoint "
            "written; launch again to run the validation and export"
        )
    if stop and state.step < t.steps:
        raise ranks.Preempted(f"after step {state.step}, checkpoint written; launch again to continue")
    ckpt.export(model, t.training_type, cfg.lora, adapter, cfg.run.output_dir, d, ema)


class TrainState:
    """The step counter, whether this step's validation is still to run, and the non-finite guard:
    tensors only, so checkpoints pickle nothing. The guard counts on the device (reading it every
    step would stall the host on the device); `check_nonfinite` reads it where the host waits
    anyway: log steps, saves and validations."""

    def __init__(self, device: torch.device):
        self.step = 0
        # A step's checkpoint is written before its validation runs: this tells a relaunch from it
        # to run that validation first, unless metrics.jsonl shows it completed (a stop cut it
        # short, or came first).
        self.validation_pending = False
        self.nonfinite_in_row = torch.zeros((), dtype=torch.int64, device=device)
        # The first step since the last check at which the count reached the limit (0: none). Never
        # saved: every save checks first, so a checkpoint never holds one.
        self.limit_reached_at = torch.zeros((), dtype=torch.int64, device=device)

    def count_nonfinite(self, nonfinite: torch.Tensor, step: int, limit: int) -> None:
        self.nonfinite_in_row = torch.where(nonfinite, self.nonfinite_in_row + 1, 0)
        first = (self.nonfinite_in_row >= limit) & (self.limit_reached_at == 0)
        self.limit_reached_at = torch.where(first, step, self.limit_reached_at)

    def check_nonfinite(self, step: int, limit: int) -> None:
        """Stop once `limit` steps in a row were non-finite: noticed here, up to train.log_every - 1
        steps after the step that reached it (those steps are skipped if non-finite too)."""
        reached = int(self.limit_reached_at)  # the guard's one host read
        if reached:
            raise ranks.StopRun(
                f"step {reached}: {limit} steps in a row with a non-finite gradient norm "
                f"(train.max_nonfinite_steps; seen at step {step}); lower train.learning_rate "
                "or check the data"
            )

    def state_dict(self) -> dict:
        return {
            "step": torch.tensor(self.step),
            "validation_pending": torch.tensor(self.validation_pending),
            "nonfinite_in_row": self.nonfinite_in_row,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.validation_pending = bool(state["validation_pending"])
        self.nonfinite_in_row = state["nonfinite_in_row"].to(self.nonfinite_in_row.device)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak learning rate in optimizer step `step` (from 1): rebuilt from the step
    alone."""
    if cfg.lr_scheduler == "constant":
        return 1.0
    if step <= cfg.lr_warmup_steps:
        return step / cfg.lr_warmup_steps
    progress = (step - cfg.lr_warmup_steps) / max(1, cfg.steps - cfg.lr_warmup_steps)
    if cfg.lr_scheduler == "linear":
        return max(0.0, 1.0 - progress)
    if cfg.lr_scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def following_clips(
    clips: list,
    sampler: Sampler,
    batch_ids: list[int],
    step: int,
    micro: int,
    t: TrainConfig,
    d: ranks.Dist,
) -> list | None:
    """This rank's clips of the micro-step after (step, micro), read while this one computes; None
    after the last step. The sampler is peeked at, not advanced: its state stays the completed
    steps'."""
    if micro + 1 < t.gradient_accumulation_steps:
        micro += 1
    elif step < t.steps:
        batch_ids, micro = sampler.peek(), 0
    else:
        return None
    return [clips[batch_ids[p]] for p in micro_slice(micro, d.dp_rank, d.dp_world, t.batch_size)]


def clip_and_step(
    params,
    optimizer,
    scaler: LossScaler,
    t: TrainConfig,
    state: TrainState,
    step: int,
    step_loss: torch.Tensor,
    zero_missing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip and step the optimizer without the host reading a device value.

    Unscale (fp16), clip once per optimizer step by the global norm (sharded gradients included),
    and step, all without the host reading a device value (but for optimizers other than AdamW:
    Optimizers.step). A step whose norm is not finite is skipped by the fused AdamW kernel itself
    (`found_inf`, as torch.amp.GradScaler hands it over), but still counts and consumes its data. The norm is global, so every rank skips the same steps.
    With fp16 such a step lowers the loss scale and counts toward train.max_nonfinite_steps only if
    its loss was not finite either: gradients overflowing a finite loss are the scale's to fix.
    Returns the norm (before clipping) and whether the update was skipped, both on the device. With
    `zero_missing`, a weight no rank's batch reached (LTX-2's audio stream in a step without sound)
    steps on a zero gradient, as FSDP's reduce-scattered zeros make it there: one process, DDP and
    FSDP take the same step."""
    if zero_missing:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    scaler.unscale_(params)
    # max_grad_norm = 0: no clipping (clip_grad_norm_ would scale every gradient to 0); the norm is
    # still logged.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    skipped = ~torch.isfinite(grad_norm)
    optimizer.step(skipped)
    optimizer.zero_grad(set_to_none=True)
    scaler.update(skipped)
    counted = skipped
    # a non-finite loss on any rank: a device-side all-reduce, not waited for on GPUs
    if scaler.enabled:
        counted = skipped & (ranks.max_over_ranks((~torch.isfinite(step_loss)).float()) > 0)
    state.count_nonfinite(counted, step, t.max_nonfinite_steps)
    state.step = step
    return grad_norm, skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cfg", required=True, help="TOML config file")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    command.run_command(train, args.cfg, overrides, lock_output_dir=True)


if __name__ == "__main__":
    main()
