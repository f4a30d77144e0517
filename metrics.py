"""Training metrics: TensorBoard, logs/metrics.jsonl, the progress line, each log line's window.

The window (TrainWindow) is the steps each log line reduces.

They are written on rank 0 only. Every other rank gets a logger whose methods do nothing, so call
sites need no rank checks (the pattern of DiT's train.py).
"""

import contextlib
import io
import json
import logging
import math
import time
from pathlib import Path

import torch
from PIL import Image
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

import memory
import ranks

log = logging.getLogger("vidtrain")


class Metrics:
    def __init__(self, output_dir: str, enabled: bool, start_step: int, total_steps: int):
        self.enabled = enabled
        self.start_step, self.total_steps = start_step, total_steps
        self.started = time.perf_counter()
        if not enabled:
            return
        logs = Path(output_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        # Events from the purge step on are dropped: those after the resumed step, or on a fresh
        # start every one of an earlier attempt that never saved a checkpoint. So a relaunch logs
        # each step once.
        purge_step = start_step + 1 if start_step else 0
        self.writer = SummaryWriter(str(logs), purge_step=purge_step)
        self.jsonl_path = logs / "metrics.jsonl"
        self._truncate_jsonl(purge_step)
        self.jsonl = self.jsonl_path.open("a")

    def _truncate_jsonl(self, purge_step: int) -> None:
        if not self.jsonl_path.exists():
            return
        kept = [
            line for line in self.jsonl_path.read_text().splitlines() if json.loads(line)["step"] < purge_step
        ]
        self.jsonl_path.write_text("".join(line + "\n" for line in kept))

    def logged_validation(self, step: int) -> bool | None:
        """Whether metrics.jsonl holds the validation of `step`, on rank 0.

        It is written once the validation has completed."""
        if not self.enabled:
            return None
        records = (json.loads(line) for line in self.jsonl_path.read_text().splitlines())
        return any(r["step"] == step and any(k.startswith("val/") for k in r) for r in records)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        # validation with no held-out clips and no prompts has nothing
        if not self.enabled or not values:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        self.writer.flush()  # a run stopped by a signal or an error keeps what it logged

    def progress(self, step: int, values: dict[str, float]) -> None:
        """step/total, loss, it/s and samples/s since the (resumed) start, ETA."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        rate = (step - self.start_step) / elapsed if elapsed > 0 else math.nan
        eta = (self.total_steps - step) / rate if rate > 0 else math.nan
        log.info(
            "step %d/%d  loss %.4f  %.2f it/s  %.1f samples/s  ETA %s",
            step,
            self.total_steps,
            values["train/loss"],
            rate,
            values["train/samples_per_s"],
            _hms(eta),
        )

    def progress_validation(self, step: int, values: dict[str, float]) -> None:
        """Show the held-out loss on the terminal's progress line.

        It measures learning; the training loss does not."""
        if not self.enabled or "val/loss" not in values:
            return
        per_t = "  ".join(
            f"t{k.removeprefix('val/loss_t')} {v:.4f}"
            for k, v in values.items()
            if k.startswith("val/loss_t")
        )
        log.info("step %d/%d  held-out loss %.4f  (%s)", step, self.total_steps, values["val/loss"], per_t)

    def clip(self, step: int, tag: str, frames, fps: int) -> None:
        """Log uint8 frames [F, H, W, 3] as an animated GIF that TensorBoard plays.

        uint8 frames [F, H, W, 3] as an animated GIF in an image summary, which TensorBoard plays.
        (SummaryWriter.add_video needs moviepy and, without it, silently logs nothing.)"""
        if not self.enabled:
            return
        images = [Image.fromarray(frame) for frame in frames.numpy()]
        gif = io.BytesIO()
        images[0].save(
            gif, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0
        )
        image = Summary.Image(
            height=frames.shape[1], width=frames.shape[2], colorspace=3, encoded_image_string=gif.getvalue()
        )
        self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def audio(self, step: int, tag: str, sound, rate: int) -> None:
        """Log a clip's soundtrack as TensorBoard's audio summary.

        A clip's soundtrack, float [channels, samples] in [-1, 1], as TensorBoard's audio summary
        (which holds one channel: the channels' mean)."""
        if self.enabled:
            self.writer.add_audio(
                tag, sound.float().mean(0, keepdim=True).clamp(-1, 1), step, sample_rate=rate
            )

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
            self.jsonl.close()


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class TrainWindow:
    """Loss (and the family's loss parts: LTX-2's video and audio), throughput and peak memory since
    the last log step, kept on the device and reduced only when logged. Validations inside the
    window are left out of its time and its peak memory."""

    def __init__(self, d: ranks.Dist, global_batch: int, start_step: int, parts: tuple[str, ...] = ()):
        self.d, self.global_batch, self.last_step = d, global_batch, start_step
        self.loss, self.start, self.first = torch.zeros((), device=d.device), time.perf_counter(), True
        # Per part: its sum over the samples that have it, and their count (adapter.losses, every
        # micro-step).
        self.part_names, self.parts = parts, torch.zeros(len(parts), 2, device=d.device)
        # steps whose update was skipped
        self.skipped = torch.zeros((), dtype=torch.int64, device=d.device)
        self.peak = 0.0  # of the window's training before a validation
        memory.reset_peak_memory(d.device, trim_heap=True)  # after the validation before step 1

    def add_step(self, loss: torch.Tensor, skipped: torch.Tensor) -> None:
        self.loss += loss
        self.skipped += skipped

    def add_parts(self, parts: torch.Tensor) -> None:
        self.parts += parts

    @contextlib.contextmanager
    def paused(self):
        """Around a validation: the training peak so far is kept, and a new one starts after it."""
        self.peak = max(self.peak, memory.peak_memory_gb(self.d.device))
        paused_at = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - paused_at
            memory.reset_peak_memory(self.d.device, trim_heap=True)

    def flush(self, step: int, grad_norm: torch.Tensor, model, optimizer, scaler) -> dict[str, float]:
        steps = step - self.last_step
        peak = torch.tensor(max(self.peak, memory.peak_memory_gb(self.d.device)), device=self.d.device)
        values = {
            "train/loss": ranks.mean_over_ranks(self.loss).item() / steps,
            "train/lr": float(optimizer.param_groups[0]["lr"]),  # torchao's is a tensor
            "train/grad_norm": grad_norm.item(),
            "train/samples_per_s": steps * self.global_batch / (time.perf_counter() - self.start),
            "train/peak_mem_gb": ranks.max_over_ranks(peak).item(),
        }
        if scaler.enabled:
            values["train/loss_scale"] = scaler.scale.item()
        # Each part's mean over the window's samples that have it (none with sound: no
        # train/loss_audio).
        parts = ranks.mean_over_ranks(self.parts).tolist() if self.part_names else []
        for name, (total, count) in zip(self.part_names, parts):
            values |= {f"train/{name}": total / count} if count else {}
        skipped = int(self.skipped)  # the same on every rank: the norm deciding it is global
        if skipped:
            log.warning(
                "steps %d-%d: %d update(s) skipped for a non-finite gradient norm (last norm %s)",
                self.last_step + 1,
                step,
                skipped,
                values["train/grad_norm"],
            )
        values["train/skipped_steps"] = skipped
        if self.first:  # parameters + optimizer state held by rank 0: shows what FSDP shards away
            values["train/state_mb"] = memory.local_state_bytes(model, optimizer) / 2**20
        self.loss.zero_()
        self.skipped.zero_()
        self.parts.zero_()
        self.last_step, self.start, self.first, self.peak = step, time.perf_counter(), False, 0.0
        memory.reset_peak_memory(self.d.device)
        return values
