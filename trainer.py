"""vidtrain: fine-tune a video diffusion transformer with LoRA or full fine-tuning.

    torchrun --nproc_per_node N trainer.py --cfg FILE.toml [--section.key value ...]
    python trainer.py --cfg FILE.toml [--section.key value ...]

Build order: frozen weights, LoRA, activation checkpointing, DDP or fully_shard, then the optimizer
over the trainable parameters only. The loop: micro-steps, clip, step, then save, then validate.
"""

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import ckpt
import data
import lora
import parallel
import validate
from config import Config, ConfigError, TrainConfig, check_resolution, load_config, to_toml
from metrics import Metrics
from model_adapter import load_adapter

log = logging.getLogger("vidtrain")


class TrainState:
    """The step counter and the non-finite guard's count: tensors only, so checkpoints pickle nothing."""

    def __init__(self):
        self.step, self.nonfinite_in_row = 0, 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step), "nonfinite_in_row": torch.tensor(self.nonfinite_in_row)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.nonfinite_in_row = int(state["step"]), int(state["nonfinite_in_row"])


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak learning rate in optimizer step `step` (from 1): rebuilt from the step alone."""
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


def prepare_data(cfg: Config, d: parallel.Dist):
    """Check the model, the resolution and every clip, and complete the cache, before any training."""
    with parallel.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
        check_resolution(cfg.data.train_resolution, adapter.frame_multiple, adapter.size_multiple)
        clips = data.read_clips(cfg.data)
        cache = data.Cache(cfg.data, adapter.identity(), adapter.text_length, cfg.model.dtype)
        encoded = data.build_cache(cache, clips, adapter, cfg.data.train_resolution, d.rank, d.world)
    adapter.release_encoders()
    log.info("cache: %d clips encoded by rank 0, %d in total in %s", encoded, len(clips), cache.dir)
    held_out = cfg.data.held_out
    return adapter, cache, clips[: len(clips) - held_out], clips[len(clips) - held_out :]


def build_model(cfg: Config, adapter, d: parallel.Dist):
    transformer = adapter.load_transformer(torch.float32 if cfg.train.training_type == "sft" else None)
    if cfg.train.training_type == "lora":
        c = cfg.lora
        lora.inject_lora(transformer, c.target_modules, c.rank, c.lora_alpha, c.dropout, cfg.run.seed)
    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    total = sum(p.numel() for p in transformer.parameters())
    log.info("parameters: %d trainable of %d (%.3f%%)", trainable, total, 100 * trainable / total)
    model = parallel.wrap(transformer, adapter.blocks(transformer), cfg.parallel, cfg.train.mixed_precision, d)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    return model, params, optimizer


def train(cfg: Config, d: parallel.Dist) -> None:
    adapter, cache, train_clips, held_out_clips = prepare_data(cfg, d)
    t = cfg.train
    global_batch = t.batch_size * t.gradient_accumulation_steps * d.world
    sampler = data.Sampler(len(train_clips), global_batch, cfg.run.seed)
    model, params, optimizer = build_model(cfg, adapter, d)
    state = TrainState()
    checkpoints = ckpt.Checkpointer(cfg.checkpoint, cfg.run.output_dir, d, ckpt.run_identity(cfg, adapter))
    checkpoints.resume({"model": model, "optimizer": optimizer, "sampler": sampler, "train": state})
    if d.is_main:
        name = f"config-resume-{state.step}.toml" if state.step else "config.toml"
        (Path(cfg.run.output_dir) / name).write_text(to_toml(cfg))
    log.info("global batch %d = %d per rank x %d accumulation x %d ranks; %d training clips, %d held out",
             global_batch, t.batch_size, t.gradient_accumulation_steps, d.world, len(train_clips), len(held_out_clips))
    metrics = Metrics(cfg.run.output_dir, d.is_main, state.step, t.steps)
    autocast = torch.autocast(d.device.type, dtype=parallel.AUTOCAST_DTYPES[t.mixed_precision],
                              enabled=t.mixed_precision != "no")
    window_loss, window_start, window_steps = torch.zeros((), device=d.device), time.perf_counter(), 0

    for step in range(state.step + 1, t.steps + 1):
        batch_ids = sampler.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = t.learning_rate * lr_factor(step, t)
        for micro in range(t.gradient_accumulation_steps):
            positions = data.micro_slice(batch_ids, micro, d.rank, d.world, t.batch_size)
            batch = cache.load_batch([train_clips[batch_ids[p]] for p in positions])
            generators = [data.keyed_generator(cfg.run.seed, step, p) for p in positions]
            lora.set_dropout_generator(model, data.keyed_generator(cfg.run.seed, step, "dropout", d.rank, micro))
            with parallel.grad_sync(model, micro == t.gradient_accumulation_steps - 1), autocast:
                loss = adapter.train_loss(model, batch, generators).mean()
            (loss / t.gradient_accumulation_steps).backward()
            window_loss += loss.detach() / t.gradient_accumulation_steps
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):
            optimizer.step()
            state.nonfinite_in_row = 0
        else:
            state.nonfinite_in_row += 1
            log.warning("step %d: gradient norm is %s, update skipped", step, grad_norm.item())
        optimizer.zero_grad(set_to_none=True)
        state.step, window_steps = step, window_steps + 1

        if step % t.log_every == 0 or step == t.steps:
            loss_value = parallel.mean_over_ranks(window_loss).item() / window_steps
            peak = parallel.max_over_ranks(torch.tensor(parallel.peak_memory_gb(d.device), device=d.device))
            rate = window_steps * global_batch / (time.perf_counter() - window_start)
            metrics.scalars(step, {"train/loss": loss_value, "train/lr": optimizer.param_groups[0]["lr"],
                                   "train/grad_norm": grad_norm.item(), "train/samples_per_s": rate,
                                   "train/peak_mem_gb": peak.item()})
            metrics.progress(step, loss_value)
            window_loss.zero_()
            window_start, window_steps = time.perf_counter(), 0
        if step % cfg.checkpoint.checkpointing_steps == 0 or step == t.steps:
            checkpoints.save(step, {"model": model, "optimizer": optimizer, "sampler": sampler, "train": state})
        if cfg.validation.do_validation and (step % cfg.validation.validation_steps == 0 or step == t.steps):
            metrics.scalars(step, validate.held_out_loss(adapter, model, cache, held_out_clips, cfg.validation,
                                                         cfg.run.seed, d, autocast))

    ckpt.export(model, cfg.train.training_type, cfg.lora, adapter, cfg.run.output_dir, d)
    metrics.close()


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", required=True, help="TOML config file")
    args, overrides = parser.parse_known_args(argv)
    return args.cfg, overrides


@record
def main(argv: list[str] | None = None) -> None:
    config_path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    d = None
    try:
        cfg = load_config(config_path, overrides)
        d = parallel.init(cfg.parallel)
        if not d.is_main:
            logging.getLogger().setLevel(logging.WARNING)
        train(cfg, d)
    except (ConfigError, parallel.StopRun, data.BadClip) as e:
        if (d.rank if d else int(os.environ.get("RANK", 0))) == 0:
            log.error("error: %s", e)
        sys.exit(1)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
