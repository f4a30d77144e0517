"""The checkpoint commands: export any checkpoint's weights, or accept a failing one's files.

    python ckpt.py export --cfg FILE.toml --checkpoint DIR [--out DIR]
    python ckpt.py rehash --cfg FILE.toml --checkpoint DIR

`python ckpt.py` stays their entry point (its `__main__` block runs main here). Export builds the
model as training does, loads the checkpoint's trained weights (ckpt.load_weights) and writes them
with export.py, by default into RUN/exports/checkpoint-N/; rehash rewrites a checkpoint's meta.json
from the files now there (ckpt_files.py holds the files and their checks)."""

import argparse
import dataclasses
import logging
from pathlib import Path

import torch.distributed.checkpoint as dcp

import ckpt
import ckpt_files
import command
import export
import ranks
from config import ConfigError
from model import EMA, build_model
from model_adapter import load_adapter

log = logging.getLogger("vidtrain")


def export_checkpoint(cfg, checkpoint: str, out: str | None, d: ranks.Dist) -> None:
    """Export a checkpoint's trained weights (and EMA).

    Builds the model as training does and loads the checkpoint's trained weights into it first."""
    # By default into the run's exports/checkpoint-N/ (its ComfyUI file named <run>_checkpoint-N):
    # never inside the checkpoint, which rotation deletes, nor over the run's own lora/, which holds
    # its final weights.
    where = Path(checkpoint).resolve()
    target = Path(out) if out else where.parent / "exports" / where.name
    with ranks.all_or_none():  # before any compute
        ckpt_files.read_meta(where)  # a checkpoint (a mistyped path makes no exports/ folder)
        problem = command.write_problem(target) if d.is_main else None
        if problem:
            raise ConfigError(
                f"the export cannot be written to {target} ({problem}): "
                f"{'choose another --out' if out else 'pass --out DIR, a folder you can write'}"
            )
        adapter = load_adapter(cfg.model, d.device)
    lora_cfg = dataclasses.replace(cfg.lora, init_from="")  # the checkpoint holds the weights
    model = build_model(adapter, cfg.train, lora_cfg, cfg.parallel, cfg.run.seed, d)
    ema = EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    # a training still running keeps this checkpoint until the export is written
    with ckpt_files.exporting(where):
        with ranks.all_or_none():
            ckpt.load_weights(
                model, checkpoint, cfg.train.training_type, ckpt.run_identity(cfg, adapter), d, ema
            )
        export.export(
            model,
            cfg.train.training_type,
            cfg.lora,
            adapter,
            str(target),
            d,
            ema,
            "" if out else f"{where.parent.name}_{where.name}",
        )


def rehash(cfg, checkpoint: str, d: ranks.Dist) -> None:
    """Accept a checkpoint's files as they are by rewriting its meta.json.

    For a checkpoint that fails its check and is wanted anyway: its meta.json is rewritten from the
    files now there (sizes, sha256) and the step its name holds. Refused when a shard its .metadata
    names is missing, when this config builds other shapes than .metadata records, or when a
    readable meta.json names another model or training (each would fail the resume). A readable
    identity is kept, else this config's is written; the record of its training clips is kept where
    the old meta.json still has one, else left out (None: not checked on resume). Loading it then
    reads whatever its shards hold."""
    path = Path(checkpoint)
    match = ckpt_files.CHECKPOINT_NAME.fullmatch(path.name)
    if not match or not (path / ".metadata").is_file():
        raise ConfigError(
            f"{path} is not a checkpoint-N folder holding DCP's .metadata, so nothing can load it: "
            "resume from another checkpoint, or start over in another run.output_dir"
        )
    with ranks.all_or_none():
        adapter = load_adapter(cfg.model, d.device)
    if not d.is_main:
        return
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    names = sorted(
        p.name for p in path.iterdir() if p.is_file() and p.name not in ("meta.json", ckpt_files.EXPORT_LOCK)
    )
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(names))
    if missing:
        raise ConfigError(
            f"{path} lacks {len(missing)} shard(s) its .metadata names (first: {missing[0]}), so no "
            "resume can read it: resume from another checkpoint, or start over in another run.output_dir"
        )
    shapes_differ = ckpt_files.other_shapes(cfg, adapter, metadata)
    if shapes_differ:
        raise ConfigError(
            f"{path} holds other shapes than {cfg.model.path} with this config builds ({shapes_differ}): "
            "rehash it with the config it was trained with (its run's config.toml)"
        )
    identity, data = ckpt.run_identity(cfg, adapter), None
    if ckpt_files.meta_problem(path) is None:
        meta = ckpt_files.read_meta(path)
        ckpt_files.check_identity(path, meta, identity)
        identity, data = meta["identity"], meta.get("data")
    # ranks that wrote shards
    writers = {name.split("_")[2] for name in names if name.endswith(".distcp")}
    files = {
        name: {"size": (path / name).stat().st_size, "sha256": ckpt_files.sha256_of(path / name)}
        for name in names
    }
    ckpt_files.write_meta(path, int(match.group(1)), len(writers), identity, data, files)
    log.info("rewrote %s: its %d files are accepted as they are", path / "meta.json", len(files))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="ckpt.py",
        description="Export the weights of any checkpoint, or accept "
        "the files of a checkpoint that fails its check (rehash).",
    )
    parser.add_argument("command", choices=["export", "rehash"])
    parser.add_argument("--cfg", required=True, help="the run's TOML config")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-N folder")
    parser.add_argument(
        "--out", help="where lora/ or transformer/ go (default: the run's exports/checkpoint-N/)"
    )
    args, overrides = parser.parse_known_args(argv)
    commands = {
        "export": lambda cfg, d: export_checkpoint(cfg, args.checkpoint, args.out, d),
        "rehash": lambda cfg, d: rehash(cfg, args.checkpoint, d),
    }
    command.run_command(commands[args.command], args.cfg, overrides)
