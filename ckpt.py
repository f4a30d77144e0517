"""Checkpoints of the training state with torch.distributed.checkpoint (DCP), and the final export.

    python ckpt.py export --cfg FILE.toml --checkpoint DIR [--out DIR]

A checkpoint is written by every rank into checkpoint-N.tmp/, then renamed to checkpoint-N/ once all
ranks are done, then `latest` is replaced. It holds the trainable weights (never the frozen base),
the optimizer's tensors (FQN-keyed, flattened, so they reshard), the sampler and the step, and a
meta.json with the sizes and sha256 of every file. No RNG state: every draw is keyed by the step.
Nothing of ours is pickled: non-tensor values are rebuilt from the config.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import lora
import parallel
from config import CheckpointConfig, ConfigError, LoraConfig

log = logging.getLogger("vidtrain")
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
FAULT_ENV = "VIDTRAIN_FAULT"


def fault(point: str, step: int) -> None:
    """Deliberate fault injection for tests: VIDTRAIN_FAULT=<point>:<step>[:<rank>] kills this
    process (points ending in "kill") or raises OSError ("fail") at that point."""
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or spec[0] != point or int(spec[1]) != step:
        return
    if len(spec) == 3 and int(spec[2]) != dist.get_rank():
        return
    if point.endswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(f"injected fault {point} at step {step}")


def run_identity(cfg, adapter) -> dict:
    """What a checkpoint must match to be resumed: the model's architecture and what is trained."""
    config = {k: v for k, v in adapter.transformer_config.items() if not k.startswith("_")}
    identity = {
        "family": cfg.model.family,
        "transformer_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "training_type": cfg.train.training_type,
    }
    if cfg.train.training_type == "lora":
        identity["lora"] = {"rank": cfg.lora.rank, "lora_alpha": cfg.lora.lora_alpha,
                            "target_modules": cfg.lora.target_modules}
    return identity


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first: checkpoint-<int>/ with DCP's .metadata and our meta.json.
    Anything else in the folder (foreign files, .tmp, best.pt) is ignored."""
    found = []
    for path in output_dir.glob("checkpoint-*"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path / ".metadata").is_file() and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def verify(path: Path) -> dict:
    """Check every file against meta.json; return the meta, or raise naming the culprit."""
    meta = json.loads((path / "meta.json").read_text())
    for name, expected in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise ConfigError(f"checkpoint {path} is missing {name}")
        if file.stat().st_size != expected["size"] or _sha256(file) != expected["sha256"]:
            raise ConfigError(f"checkpoint {path}: {name} does not match its size or sha256 in meta.json")
    return meta


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, output_dir: str, d: parallel.Dist, identity: dict):
        self.cfg, self.dir, self.d, self.identity = cfg, Path(output_dir), d, identity
        self.frozen_excluded = identity["training_type"] == "lora"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _state(self, objects: dict) -> dict:
        """The tensors to save or fill: model and optimizer through DCP's FQN-keyed helpers; the rest
        through state_dict()."""
        options = StateDictOptions(ignore_frozen_params=self.frozen_excluded, flatten_optimizer_state_dict=True)
        model, optimizer = objects["model"], objects["optimizer"]
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        state = {
            "model": get_model_state_dict(model, options=options),
            # param_groups (lr, betas) are plain numbers rebuilt from the config: only tensors are saved.
            "optimizer": {k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)},
        }
        for name, obj in objects.items():
            if name not in ("model", "optimizer"):
                state[name] = obj.state_dict()
        return state

    def save(self, step: int, objects: dict) -> None:
        final, tmp = self.dir / f"checkpoint-{step}", self.dir / f"checkpoint-{step}.tmp"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        with parallel.all_or_none():
            fault("save_fail", step)
            dcp.save(self._state(objects), checkpoint_id=tmp)
        fault("save_kill", step)
        self._commit(step, tmp, final)

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        """Hash this rank's share of files, then rank 0 writes meta.json, renames, updates latest, rotates."""
        files = sorted(p.name for p in tmp.iterdir())
        mine = {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)}
                for i, n in enumerate(files) if i % self.d.world == self.d.rank}
        shares = [None] * self.d.world
        dist.all_gather_object(shares, mine)
        if self.d.is_main:
            meta = {
                "step": step,
                "world_size": self.d.world,
                "identity": self.identity,
                "versions": {p: version(p) for p in ("torch", "diffusers", "transformers")},
                "files": {k: v for share in shares for k, v in sorted(share.items())},
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp, final)
            latest_tmp = self.dir / "latest.tmp"
            latest_tmp.write_text(f"{final.name}\n")
            os.replace(latest_tmp, self.dir / "latest")
            self._rotate()
            log.info("saved %s", final)
        dist.barrier()

    def _rotate(self) -> None:
        if self.cfg.checkpointing_limit == 0:
            return
        for path in complete_checkpoints(self.dir)[: -self.cfg.checkpointing_limit]:
            shutil.rmtree(path)

    def _choose(self) -> tuple[Path | None, str]:
        """On rank 0: the checkpoint to resume from, and a message about any that was passed over."""
        for tmp in self.dir.glob("checkpoint-*.tmp"):
            shutil.rmtree(tmp)
        found = complete_checkpoints(self.dir)
        if self.cfg.resume == "none":
            if found:
                raise ConfigError(f"{self.dir} already holds {found[-1].name}: set checkpoint.resume = \"auto\" "
                                  "to continue it, or choose another run.output_dir")
            return None, ""
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if not (path / "meta.json").is_file():
                raise ConfigError(f"checkpoint.resume = {path} is not a checkpoint folder (no meta.json)")
            verify(path)
            return path, ""
        skipped = ""
        for path in reversed(found):
            try:
                verify(path)
                return path, skipped
            except (ConfigError, OSError, ValueError) as e:
                skipped += f"{e}; falling back to the previous checkpoint. "
        return None, skipped

    def resume(self, objects: dict) -> None:
        """Load the chosen checkpoint into the live objects on every rank; resharding is DCP's."""
        choice = [None, ""]
        with parallel.all_or_none():
            if self.d.is_main:
                path, skipped = self._choose()
                choice = [str(path) if path else None, skipped]
        dist.broadcast_object_list(choice, src=0)
        path, skipped = choice
        if skipped:
            log.warning("%s", skipped)
        if path is None:
            return
        with parallel.all_or_none():
            meta = json.loads((Path(path) / "meta.json").read_text())
            self._check_identity(Path(path), meta)
            state = self._state(objects)
            dcp.load(state, checkpoint_id=path)
            options = StateDictOptions(strict=not self.frozen_excluded, flatten_optimizer_state_dict=True)
            set_model_state_dict(objects["model"], state["model"], options=options)
            optim_state = get_optimizer_state_dict(objects["model"], objects["optimizer"], options=options)
            set_optimizer_state_dict(objects["model"], objects["optimizer"], {**optim_state, **state["optimizer"]},
                                     options=options)
            for name, obj in objects.items():
                if name not in ("model", "optimizer"):
                    obj.load_state_dict(state[name])
        log.info("resumed from step %d (%s)", meta["step"], path)

    def _check_identity(self, path: Path, meta: dict) -> None:
        saved, ours = meta["identity"], self.identity
        for key in sorted(set(saved) | set(ours)):
            if saved.get(key) != ours.get(key):
                raise ConfigError(
                    f"checkpoint {path} was trained with {key} = {saved.get(key)}, this run has {ours.get(key)}: "
                    "resume with the same model and training settings, or start in another run.output_dir"
                )


def export(model, training_type: str, lora_cfg: LoraConfig, adapter, out_dir: str, d: parallel.Dist) -> None:
    """Gather only the exported weights to rank 0 and write them: the LoRA in diffusers' and PEFT's
    layouts, or the full transformer with save_pretrained."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=training_type == "lora")
    state = get_model_state_dict(model, options=options)
    if not d.is_main:
        return
    out = Path(out_dir)
    if training_type == "lora":
        weights = {k: v.float() for k, v in state.items()}
        (out / "lora").mkdir(parents=True, exist_ok=True)
        lora.save_lora(str(out / "lora" / "pytorch_lora_weights.safetensors"), weights, lora_cfg.rank,
                       lora_cfg.lora_alpha, lora_cfg.target_modules)
        lora.save_peft_adapter(str(out / "lora"), weights, lora_cfg.rank, lora_cfg.lora_alpha, lora_cfg.target_modules)
        log.info("LoRA written to %s", out / "lora" / "pytorch_lora_weights.safetensors")
    else:
        transformer = adapter.transformer_from_state_dict(state)
        transformer.save_pretrained(out / "transformer")
        log.info("transformer written to %s", out / "transformer")
