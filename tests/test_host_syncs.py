"""A training step leaves the host free: no device value is read on a plain step.

A training step leaves the host free: on steps that neither log, save nor validate, nothing reads a
device value (no .item(), bool() or isfinite of a device tensor), so the host queues step after step
while the device works. Counted in process by a TorchDispatchMode on aten._local_scalar_dense, the
op behind every such read; on a GPU also by CUDA's own check,
torch.cuda.set_sync_debug_mode("error"), which catches blocking copies too (that path needs a GPU:
it is skipped on CPU-only machines)."""

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO
from torch.utils._python_dispatch import TorchDispatchMode

import cache
import faults
import ranks
import trainer
from config import RunConfig, load_config
from data import Sampler, micro_slice
from families.cogvideox import CogVideoXAdapter

# Host reads allowed on a step that does not log, keyed by (root module, function), with the reason.
ALLOWED = {
    ("ranks.py", "agreed_a_step_late"): "the preemption flag: a CPU tensor all-reduced over gloo a step "
    "earlier, so reading it waits neither for the device nor for a peer",
}
# Counted: from step 2's first loss to step 6's, so steps 2..5's backward passes, updates and
# boundaries: step 1 sets up lazily, step 6 is the last (log, save, export).
STEPS = 6
VARIANTS = {
    # accumulation, EMA and a NaN loss (a skipped update) inside the counted steps
    "one_process": {"train.gradient_accumulation_steps": 2, "train.ema_decay": 0.9},
    # the loss scale, an overflow it recovers from, and LoRA dropout's keyed generator
    "fp16": {"train.mixed_precision": "fp16", "lora.dropout": 0.1},
    # DTensor parameters and gradients: the norm, the clip and the fused step of sharded state
    "fsdp": {"parallel.strategy": "fsdp", "train.ema_decay": 0.9},
}
FAULTS = {"one_process": "nan_loss:3", "fp16": "overflow:3", "fsdp": "nan_loss:3"}


def caller() -> tuple[str, str, int]:
    """The innermost function of our own modules (the root's and the families') in the current stack
    (comprehensions are frames of their own: their function is the one around them)."""
    ours = [
        f
        for f in traceback.extract_stack()
        if Path(f.filename).parent in (REPO, REPO / "families") and not f.name.startswith("<")
    ]
    return (Path(ours[-1].filename).name, ours[-1].name, ours[-1].lineno) if ours else ("?", "?", 0)


class HostReads(TorchDispatchMode):
    """Every aten._local_scalar_dense (item(), bool(), int(), float() of a tensor) while `counting`."""

    def __init__(self):
        super().__init__()
        self.counting, self.ops, self.reads = False, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.ops += 1
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads.append((*caller(), args[0].device.type))
        return func(*args, **(kwargs or {}))


def run_counting(write_config, monkeypatch, variant: str, device: torch.device, on_window, **family):
    """Train STEPS steps in this process, calling on_window(True) at step 2's first loss and
    on_window(False) at step STEPS's (the loop's fault hook, faults.on_loss, marks the steps)."""
    settings = {
        "train.steps": STEPS,
        "train.log_every": 100,
        "checkpoint.checkpointing_steps": 100,
        "validation.do_validation": False,
        **VARIANTS[variant],
        **family,
    }
    cfg = load_config(str(write_config(variant, **settings)))
    monkeypatch.setenv("VIDTRAIN_FAULT", FAULTS[variant])
    original = faults.fault

    def fault(point, count):
        if point == "step" and count in (2, STEPS):
            on_window(count == 2)
        original(point, count)

    monkeypatch.setattr(faults, "fault", fault)
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer.train(cfg, ranks.Dist(0, 1, 0, device))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_host_reads_on_steps_that_do_not_log(write_config, monkeypatch, variant):
    mode = HostReads()
    with mode:
        run_counting(
            write_config, monkeypatch, variant, torch.device("cpu"), lambda on: setattr(mode, "counting", on)
        )
    assert mode.ops > 1000  # the counted steps ran under the mode
    unexpected = [read for read in mode.reads if read[:2] not in ALLOWED]
    assert unexpected == [], f"host reads of tensors on steps that do not log: {unexpected}"
    # The allowed read happens once per counted step boundary: the list names only what happens.
    assert sorted({read[:2] for read in mode.reads}) == sorted(ALLOWED)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync check needs a GPU")
@pytest.mark.parametrize("family", ["cogvideox", "wan"])
@pytest.mark.parametrize("variant", ["one_process", "fp16"])
def test_no_device_syncs_on_a_gpu(write_config, monkeypatch, wan_models, variant, family):
    """On a GPU, CUDA itself finds no synchronising call in the counted steps.

    On a GPU CUDA itself raises at any synchronising call (a device read, a blocking copy) in the
    counted steps, for each family; the dispatch mode checks that the allowed reads are of CPU
    tensors."""
    mode = HostReads()
    settings = {"model.path": str(wan_models("t2v")), "model.family": "wan"} if family == "wan" else {}

    def on_window(on: bool) -> None:
        mode.counting = on
        torch.cuda.set_sync_debug_mode("error" if on else "default")

    try:
        with mode:
            run_counting(write_config, monkeypatch, variant, torch.device("cuda", 0), on_window, **settings)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [read for read in mode.reads if read[:2] not in ALLOWED or read[3] != "cpu"] == []


def test_read_ahead_batches_are_the_samplers(write_config, monkeypatch):
    """The batches read ahead are the ones the sampler and the cache give.

    The batches the step trains on, each read while the micro-step before it computes, are those the
    sampler and the cache give without reading ahead: same clips, same order, across the
    accumulation's micro-steps, the steps, the epoch's end (20 clips, 5 global batches of 4 per
    epoch) and the NaN step."""
    prepared, trained, reads = [], [], []
    prepare, train_loss, read = cache.prepare, CogVideoXAdapter.train_loss, cache.Prefetch.host
    monkeypatch.setattr(cache, "prepare", lambda *args: prepared.append(prepare(*args)) or prepared[0])
    monkeypatch.setattr(
        cache.Prefetch, "host", lambda prefetch, items: reads.append(items) or read(prefetch, items)
    )

    def recorded(adapter, model, batch, generators):
        trained.append({k: v.clone() for k, v in batch.items()})
        return train_loss(adapter, model, batch, generators)

    monkeypatch.setattr(CogVideoXAdapter, "train_loss", recorded)
    run_counting(write_config, monkeypatch, "one_process", torch.device("cpu"), lambda on: None)
    entries, clips, _ = prepared[0]
    sampler = Sampler([item.bucket for item in clips], 4, RunConfig().seed)
    expected = []
    for _ in range(STEPS):
        batch_ids = sampler.next_batch()
        expected += [
            entries.load_batch([clips[batch_ids[p]] for p in micro_slice(micro, 0, 1, 2)])
            for micro in range(2)
        ]
    assert sampler.epoch == 1 and len(trained) == len(expected) == 2 * STEPS
    # Each read once: the first when the run starts, every other one while the micro-step before it
    # computed.
    assert len(reads) == 2 * STEPS, f"{len(reads)} reads"
    for step, (ours, theirs) in enumerate(zip(trained, expected)):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), (
            step // 2 + 1
        )
