"""Checkpoints of the training state with torch.distributed.checkpoint (DCP).

A checkpoint is written by every rank into checkpoint-N.tmp/, then renamed to checkpoint-N/ once all
ranks are done, then `latest` is replaced. It holds the trainable weights (never the frozen base),
the optimizer's tensors (FQN-keyed, flattened, so they reshard), the sampler and the step, and a
meta.json with the sizes and sha256 of every file. No RNG state: every draw is keyed by the step.
Nothing of ours is pickled: non-tensor values are rebuilt from the config. Loading only the trained
weights (load_weights) serves rendering and export. The commands on a checkpoint (`python ckpt.py
export` and `python ckpt.py rehash`, this module's `__main__` block) are ckpt_commands.py's;
a checkpoint's files and their checks are ckpt_files.py's.
"""

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import ckpt_files
import faults
import ranks
from config import CheckpointConfig, ConfigError
from model import model_state

log = logging.getLogger("vidtrain")


def run_identity(cfg, adapter) -> dict:
    """What a checkpoint must match to be resumed.

    The model's architecture, its base weights (a resume on others is refused), their precision (a
    change is named) and what is trained."""
    config = {k: v for k, v in adapter.transformer_config.items() if not k.startswith("_")}
    identity = {
        "family": adapter.FAMILY,  # model.family as resolved: "" names the folder's
        "transformer_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "training_type": cfg.train.training_type,
        "base": ckpt_files.base_identity(adapter),
        "precision": {"model.dtype": cfg.model.dtype, "model.storage_dtype": cfg.model.storage_dtype},
    }
    if cfg.train.training_type == "lora":
        identity["lora"] = {
            "rank": cfg.lora.rank,
            "lora_alpha": cfg.lora.lora_alpha,
            "target_modules": cfg.lora.target_modules,
        }
    return identity


def data_identity(clips: list) -> dict:
    """The training clips a checkpoint's sampler state indexes, known by content.

    What a checkpoint's sampler state indexes: the training clips, per bucket and in order, by their
    contents and prompts (not their paths: a dataset moved elsewhere still resumes)."""
    per_bucket = collections.Counter(str(list(item.resolution)) for item in clips)
    keys = [[item.content, item.image_content, item.clip.prompt, item.bucket] for item in clips]
    return {
        "clips_per_bucket": dict(sorted(per_bucket.items())),
        "clips_sha256": hashlib.sha256(json.dumps(keys).encode()).hexdigest(),
    }


@torch.no_grad()
def _identity(tensor: torch.Tensor) -> tuple:
    """What a view of `tensor` depends on.

    The object, its local data (a DTensor's shard), requires_grad."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return id(tensor), local.data_ptr(), local.shape, tensor.requires_grad


def cached_planner() -> dcp.DefaultSavePlanner:
    """DCP's planner with a plan cache, reused by every save of one layout.

    Every save of a run has the same layout, so after the first one each rank sends an empty plan
    when its local plan matches the cached one and the coordinator reuses the global plan and
    metadata (the data still comes from this save's tensors; another layout is planned afresh). The
    cache is per process: sync and async saves of one layout share it safely."""
    return dcp.DefaultSavePlanner(enable_plan_caching=True)


def staging_copy() -> DefaultStager:
    """The CPU copy of this rank's state that an async save stages into, kept from save to save.

    What an async save copies this rank's state into before training continues: DCP's stager keeps
    one CPU copy per source tensor (storage) and refills it at every save, where a fresh stager
    would allocate the whole state again each time (docs/checkpoints.md gives its size for Wan 14B
    sft with EMA); pinned on GPUs, so the device-to-host copy runs at full speed. Refilling is safe:
    each save waits for the previous write before it stages."""
    on_gpu = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=on_gpu,
        )
    )


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, output_dir: str, d: ranks.Dist, identity: dict, data: dict):
        """identity: run_identity's; data: data_identity's, of the training clips."""
        self.cfg, self.dir, self.d, self.identity, self.data = cfg, Path(output_dir), d, identity, data
        self.frozen_excluded = identity["training_type"] == "lora"
        self.async_group, self.pending, self.saved_step, self.views = None, None, None, None
        # async saves' CPU copy of this rank's state, made once and refilled by every save
        self.stager = None
        self.syncer = concurrent.futures.ThreadPoolExecutor(1)
        # this rank's fsync of the newest checkpoint's files, running in the background
        self.syncing = None
        self.dir.mkdir(parents=True, exist_ok=True)

    def _state(self, objects: dict, reuse: bool = False) -> dict:
        """The tensors to save or fill, kept between saves while they still alias the live ones.

        Model and optimizer come through DCP's FQN-keyed helpers, the rest through state_dict().
        Saves (`reuse`) keep the helpers' output, which aliases the live tensors (parameters, FSDP
        shards, AdamW's state: all updated in place), rather than map every module's names again at
        every save (BENCHMARKS.md, "Checkpoints", has the cost); a replaced tensor (the optimizer's
        first step, a resume), swapped storage (.data, FSDP's reset_sharded_param) or changed
        requires_grad rebuilds it. The kept tensors stay alive, so no other tensor can take one of
        their ids."""
        model, optimizer = objects["model"], objects["optimizer"]
        tensors = [
            *model.parameters(),
            *model.buffers(),
            *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        ]
        key = tuple(_identity(t) for t in tensors)
        if reuse and self.views and self.views[1] == key:
            views = self.views[2]
        else:
            options = StateDictOptions(
                ignore_frozen_params=self.frozen_excluded, flatten_optimizer_state_dict=True
            )
            optim_state = get_optimizer_state_dict(model, optimizer, options=options)
            views = {
                "model": model_state(
                    model, self.identity["training_type"], flatten_optimizer_state_dict=True
                ),
                # param_groups (lr, betas) are plain numbers rebuilt from the config: only tensors
                # are saved.
                "optimizer": {k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)},
            }
            # a resume's build is not kept: it must not pin optimizer state the load replaces
            if reuse:
                self.views = (tensors, key, views)
        return {**views, **{k: v.state_dict() for k, v in objects.items() if k not in ("model", "optimizer")}}

    def save(self, step: int, objects: dict, final: bool) -> None:
        """Every rank writes its shards.

        With async_save the write runs in the background and commits at the next save; the final
        save is synchronous so the run ends committed."""
        self.wait_and_commit()
        if step == self.saved_step:  # a stop right after this step's save: it is committed already
            return
        self.saved_step = step
        final_dir, tmp = self.dir / f"checkpoint-{step}", self.dir / f"checkpoint-{step}.tmp"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        failing = faults.active("save_fail", step)
        writer = (ckpt_files.FailingWriter if failing else ckpt_files.HashingWriter)(tmp)
        with ranks.all_or_none():
            state = self._state(objects, reuse=True)
            if self.cfg.async_save and not final:
                if self.async_group is None:
                    # Background writes on the default group collide with training's collectives.
                    self.async_group = dist.new_group(backend="gloo")
                    self.stager = staging_copy()
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=cached_planner(),
                    process_group=self.async_group,
                    async_stager=self.stager,
                )
                self.pending = (step, tmp, final_dir, future, writer)
                return
            with ckpt_files.write_failures_named(tmp):
                dcp.save(state, storage_writer=writer, planner=cached_planner())
        faults.fault("save", step)
        self._commit(step, tmp, final_dir, writer.fs.written, last=final)

    def wait_and_commit(self) -> None:
        """Finish the background save, if one is running, and commit it on every rank."""
        if self.pending is None:
            return
        step, tmp, final_dir, future, writer = self.pending
        self.pending = None
        with ranks.all_or_none(), ckpt_files.write_failures_named(tmp):
            future.result()
        faults.fault("save", step)
        self._commit(step, tmp, final_dir, writer.fs.written, last=False)

    def _commit(self, step: int, tmp: Path, final: Path, mine: dict, last: bool) -> None:
        """Commit a written checkpoint: meta.json, rename, `latest`, rotation.

        Gather the sizes and sha256 of the files every rank wrote (`mine`: this rank's), then rank 0
        writes meta.json, renames, updates latest, rotates. A checkpoint reaches the disk in the
        background (each rank fsyncs its files; until then a crash of the machine, not of the
        process, could damage it, which its check on resume finds): rotation counts only checkpoints
        every rank has synced, so between saves one more than checkpointing_limit is kept; the last
        save of a launch waits for its own."""
        if self.syncing is not None:  # the previous checkpoint's, started a save interval ago
            self.syncing.result()
        shares = [None] * self.d.world
        dist.all_gather_object(shares, mine)
        if self.d.is_main:
            files = {k: v for share in shares for k, v in sorted(share.items())}
            ckpt_files.write_meta(tmp, step, self.d.world, self.identity, self.data, files)
            # one that failed its check on resume, recomputed since: move it aside first
            if final.exists():
                stale = final.with_name(f"{final.name}.stale.tmp")
                os.replace(final, stale)
                os.replace(tmp, final)
                shutil.rmtree(stale)
            else:
                os.replace(tmp, final)
            latest_tmp = self.dir / "latest.tmp"
            latest_tmp.write_text(f"{final.name}\n")
            os.replace(latest_tmp, self.dir / "latest")
            log.info("saved %s", final)
        dist.barrier()
        written = [*mine, "meta.json"] if self.d.is_main else list(mine)
        self.syncing = self.syncer.submit(ckpt_files.fsync_files, [final / name for name in written])
        if last:
            self.syncing.result()
            dist.barrier()
        if self.d.is_main:
            self._rotate([p for p in ckpt_files.complete_checkpoints(self.dir) if last or p != final])

    def _rotate(self, synced: list[Path]) -> None:
        if self.cfg.checkpointing_limit == 0:
            return
        for path in synced[: -self.cfg.checkpointing_limit]:
            lock = ckpt_files.deletable(path)
            if lock is None:
                log.info("keeping %s while `ckpt.py export` reads it: a later rotation deletes it", path)
                continue
            with lock:
                shutil.rmtree(path)

    def _candidates(self) -> list[Path]:
        """The checkpoints to try, newest first, as rank 0 sees them.

        Leftover .tmp folders are removed."""
        found = None
        with ranks.all_or_none():
            if self.d.is_main:
                for tmp in self.dir.glob("checkpoint-*.tmp"):
                    shutil.rmtree(tmp)
                found = [str(p) for p in reversed(ckpt_files.checkpoint_folders(self.dir))]
        found = ranks.broadcast(found, self.d)
        if self.cfg.resume == "none" and found:
            raise ConfigError(
                f'{self.dir} already holds {Path(found[0]).name}: set checkpoint.resume = "auto" '
                "to continue it, or choose another run.output_dir"
            )
        if self.cfg.resume not in ("auto", "none"):
            ckpt_files.read_meta(Path(self.cfg.resume))
            return [Path(self.cfg.resume)]
        return [Path(p) for p in found] if self.cfg.resume == "auto" else []

    def _none_passes(self, candidates: list[Path], skipped: list[str]) -> str:
        """The message when every checkpoint fails its check: both ways on, spelled out."""
        message = (
            f"no checkpoint in {self.dir} passes its check ({'; '.join(skipped)}): to start over, choose "
            "another run.output_dir"
        )
        loadable = [p for p in candidates if (p / ".metadata").is_file()]
        if loadable:
            message += (
                f"; to resume from {loadable[0].name} anyway, accept its files as they are with `python "
                f"ckpt.py rehash --cfg {self.dir / 'config.toml'} --checkpoint {loadable[0]}` and launch again"
            )
        return message

    def resume(self, objects: dict) -> Path | None:
        """Load the newest checkpoint that checks out, falling back to older ones; return its path.

        The checkpoint is loaded into the live objects on every rank; resharding is DCP's. A stop
        signal before the check ends the run here."""
        ranks.stop_if_preempted(self.d, "before resuming, with nothing new to save")
        candidates = self._candidates()
        state, skipped = self._state(objects), []
        for path in candidates:
            problem = next((p for p in ranks.agree(lambda: ckpt_files.meta_problem(path), self.d) if p), None)
            if problem is None:
                # another model, LoRA or dataset: stop, do not fall back
                with ranks.all_or_none():
                    meta = ckpt_files.read_meta(path)
                    ckpt_files.check_identity(path, meta, self.identity, resuming=True)
                    ckpt_files.check_data(path, meta, self.data)
                problem = ckpt_files.reads_problem(path, state, self.d)
            if problem is None:
                break
            if self.cfg.resume != "auto":
                raise ConfigError(problem)
            skipped.append(problem)
            log.warning("%s; falling back to the previous checkpoint", problem)
        else:
            # starting over would overwrite the damaged ones: leave that decision to the user
            if candidates:
                raise ConfigError(self._none_passes(candidates, skipped))
            return None
        with ranks.all_or_none():
            meta = ckpt_files.read_meta(path)
            dcp.load(state, checkpoint_id=str(path))
            options = StateDictOptions(strict=not self.frozen_excluded, flatten_optimizer_state_dict=True)
            set_model_state_dict(objects["model"], state["model"], options=options)
            optim_state = get_optimizer_state_dict(objects["model"], objects["optimizer"], options=options)
            set_optimizer_state_dict(
                objects["model"], objects["optimizer"], {**optim_state, **state["optimizer"]}, options=options
            )
            for name, obj in objects.items():
                if name not in ("model", "optimizer"):
                    obj.load_state_dict(state[name])
        self.saved_step = meta["step"]
        log.info("resumed from step %d (%s)", meta["step"], path)
        return path


def load_weights(model, path: str, training_type: str, identity: dict, d: ranks.Dist, ema=None) -> None:
    """Load only a checkpoint's trained weights (and EMA) into a built model.

    Only the trained weights (and the EMA, when given) of a checkpoint into an already built model:
    for rendering and export, without the optimizer. Every rank calls it."""
    ckpt_files.check_identity(Path(path), ckpt_files.read_meta(Path(path)), identity)
    options = StateDictOptions(ignore_frozen_params=training_type == "lora", strict=training_type != "lora")
    state = {"model": model_state(model, training_type)}
    if ema is not None:
        state["ema"] = ema.state_dict()
    problem = ckpt_files.reads_problem(Path(path), state, d, allow_partial_load=True)
    if problem:
        raise ConfigError(problem)
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, state["model"], options=options)


if __name__ == "__main__":  # the commands' documented entry point; ckpt_commands.py holds them
    import ckpt_commands

    ckpt_commands.main(sys.argv[1:])
