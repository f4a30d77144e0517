"""The registry of families: model.family -> its adapter class, checked against the contract.

ADAPTERS names each family's module and class (families/*.py), imported only when a config names
the family or the config check reads its OWN_KEYS. A family class is checked against the contract
(model_adapter.Adapter) when it is imported, and its adapter once built, so that a family that
leaves out part of it is named before it runs; check_config holds a run's config to its family's
options, and load_adapter builds the run's adapter over model.path.
"""

import importlib
import json
from pathlib import Path

import torch

import weights
from config import Config, ConfigError, ModelConfig
from model_adapter import Adapter, RunSettings, config_sets, not_a_model_folder

# model.family -> its module and adapter class. A family's module (and with it its diffusers and
# transformers classes) is imported when a config names it or check_config reads its OWN_KEYS.
ADAPTERS = {
    "cogvideox": ("families.cogvideox", "CogVideoXAdapter"),
    "wan": ("families.wan", "WanAdapter"),
    "ltx2": ("families.ltx2", "LTX2Adapter"),
}


def missing_members(family: type[Adapter], adapter: Adapter | None = None) -> list[str]:
    """What the family class (or, given it, its adapter's __init__) leaves out of the contract: the
    abstract methods, SOUND with sound, SINGLE_FILES with a SINGLE_FILE_KEY, and the attributes
    __init__ sets."""
    if adapter is None:
        groups = [
            name
            for name, wanted in (
                ("SOUND", "audio" in family.ENCODERS),
                ("SINGLE_FILES", bool(family.SINGLE_FILE_KEY)),
            )
            if wanted
        ]
        # A member of a group the family needs is missing while it is still Adapter's own
        # declaration.
        unfilled = [
            n
            for group in groups
            for n in getattr(Adapter, group)
            if getattr(family, n) is getattr(Adapter, n)
        ]
        return sorted(family.__abstractmethods__) + unfilled
    wanted = ["transformer_config"] + ["losses"] * bool(family.LOSS_PARTS)
    wanted += ["sound_rate", "audio_loss_weight"] * ("audio" in family.ENCODERS)
    return [name for name in wanted if not hasattr(adapter, name)]


def check_family(family: type[Adapter], adapter: Adapter | None = None) -> None:
    """A family class that does not fill the contract is named, with what it lacks, before it runs."""
    missing = missing_members(family, adapter)
    if missing:
        raise TypeError(
            f"the family adapter {family.__module__}.{family.__name__} does not provide "
            f"{', '.join(missing)}: every family defines them "
            "(model_adapter.Adapter declares each, docs/adding-a-family.md lists them)"
        )


def adapter_class(family: str) -> type[Adapter]:
    """model.family's adapter class, imported now (ADAPTERS) and checked against the contract."""
    module, name = ADAPTERS[family]
    cls = getattr(importlib.import_module(module), name)
    check_family(cls)
    return cls


def family_of(cfg: ModelConfig) -> str:
    """model.family, checked against the registry and the folder's pipeline; "": the folder's
    family.

    The pipeline is model_index.json's: another family's folder would fail obscurely in its configs.
    """
    known = ", ".join(f'"{family}"' for family in ADAPTERS)
    if cfg.family and cfg.family not in ADAPTERS:
        raise ConfigError(
            f'model.family = "{cfg.family}" is no family vidtrain trains: set one of '
            f'{known}, or "" for the family of model.path\'s pipeline'
        )
    index = Path(cfg.path) / "model_index.json"  # none, with a family set: the adapter says so
    pipeline = json.loads(index.read_text()).get("_class_name", "") if index.is_file() else ""
    family = next((f for f in ADAPTERS if pipeline.lower().startswith(f)), None)
    if pipeline and cfg.family and family != cfg.family:
        fix = f'set model.family = "{family}"' if family else f"vidtrain trains {', '.join(ADAPTERS)}"
        raise ConfigError(
            f"model.path = {cfg.path} holds a {pipeline} (its model_index.json), not a model of "
            f'model.family = "{cfg.family}": {fix}'
        )
    if not cfg.family and not pipeline:
        raise ConfigError(not_a_model_folder(cfg.path))
    if not cfg.family and family is None:
        raise ConfigError(
            f"model.path = {cfg.path} holds a {pipeline} (its model_index.json), which "
            f"is no family vidtrain trains: point model.path at a model of one of {known}"
        )
    return cfg.family or family


def check_config(cfg: Config) -> type[Adapter]:
    """The config against its family's options; returns the family's adapter class.

    model.family is checked against the registry; a key only another family accepts (its OWN_KEYS)
    stops the run with that family's message; then the family's own check_config runs. Nothing of
    the model is read but its model_index.json.
    """
    cls = adapter_class(family_of(cfg.model))
    for family in ADAPTERS:
        for key, message in adapter_class(family).OWN_KEYS.items():
            if key not in cls.OWN_KEYS and config_sets(cfg, key):
                raise ConfigError(message.format(key=key, family=cls.FAMILY))
    cls.check_config(cfg)
    return cls


def load_adapter(cfg: ModelConfig, device: torch.device, run: RunSettings = RunSettings()) -> Adapter:
    """model.family's adapter over the folder at model.path, built with the run's settings.

    With model.transformer_file, the file's reader too (single_file.SingleFile), checked against the
    folder's transformer config.
    """
    family = family_of(cfg)
    cls = adapter_class(family)
    adapter = cls(cfg, device, run)
    check_family(cls, adapter)
    if cfg.transformer_file:  # checked now, before the cache pass
        if not adapter.SINGLE_FILE_KEY:
            raise ConfigError(
                f"model.transformer_file: vidtrain reads no single files of {family} models yet; "
                "remove it and give the diffusers folder's transformer in model.path"
            )
        marks = {family: adapter_class(family).SINGLE_FILE_KEY for family in ADAPTERS}
        files = [cfg.transformer_file] if isinstance(cfg.transformer_file, str) else cfg.transformer_file
        adapter.single_file = weights.open_single_file(files, adapter, marks)
    return adapter
