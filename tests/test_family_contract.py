"""The family contract (model_adapter.Adapter): a family that leaves out part of it is named, with
what it lacks, when it is loaded, not by an AttributeError mid-run; the three families fill it. And
the families own their options: config.py names none, each family declares the keys only it accepts
(OWN_KEYS), and a run of another family refuses them before anything is read."""

import dataclasses
import logging
import re
import sys
import typing

import pytest
import torch
from conftest import REPO

import model_adapter
import trainer
from config import Config, ConfigError, ModelConfig, load_config
from families.cogvideox import CogVideoXAdapter
from families.ltx2 import LTX2Adapter
from families.wan import WanAdapter
from model_adapter import ADAPTERS, Adapter, adapter_class, check_config, check_family, load_adapter

REQUIRED = ["--run.output_dir", "/tmp/out", "--model.path", "/nowhere", "--data.data_root", "/d"]


def without(family: type[Adapter], *names: str) -> type[Adapter]:
    """A copy of a family's adapter class, defined on Adapter directly, that forgets `names`."""
    own = ("__dict__", "__weakref__", "__module__", "__qualname__")
    namespace = {k: v for k, v in vars(family).items() if k not in names + own}
    return type(f"Forgetful{family.__name__}", (Adapter,), {**namespace, "__module__": __name__})


# module-level: ADAPTERS names classes by module
ForgetfulWanAdapter = without(WanAdapter, "sampling_step")
# A fourth family with no keys of its own (CogVideoX's methods, Adapter's empty OWN_KEYS), and one
# that also accepts CogVideoX's validation.use_dynamic_cfg: each is its class plus one registry
# line.
PlainAdapter = without(CogVideoXAdapter, "OWN_KEYS", "FAMILY")
DynamicAdapter = type(
    "DynamicAdapter",
    (PlainAdapter,),
    {"OWN_KEYS": {"validation.use_dynamic_cfg": "unused: CogVideoX's message is the one shown"}},
)


def other_value(key: str):
    """A value of `key` ("section.name") other than its default, of the schema's type."""
    section, name = key.split(".")
    values = getattr(Config(), section)
    default, kind = getattr(values, name), typing.get_type_hints(type(values))[name]
    if typing.get_origin(kind) is typing.Literal:
        return next(v for v in typing.get_args(kind) if v != default)
    if kind in (float, int):
        return default + 1
    return not default if kind is bool else [1]  # a list of block numbers


def with_key(family: str, key: str, value) -> Config:
    cfg = load_config(None, REQUIRED + ["--model.family", family])
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_family_that_forgets_a_required_method_is_named_at_load(monkeypatch):
    """A family that forgets a required method is named when it loads.

    load_adapter stops before reading the model folder, in one message naming the class and member.
    """
    monkeypatch.setitem(ADAPTERS, "wan", (__name__, "ForgetfulWanAdapter"))
    with pytest.raises(TypeError) as error:
        load_adapter(ModelConfig(family="wan", path="/nowhere"), torch.device("cpu"))
    assert str(error.value) == (
        f"the family adapter {__name__}.ForgetfulWanAdapter does not provide "
        "sampling_step: every family defines them (model_adapter.Adapter declares "
        "each, docs/adding-a-family.md lists them)"
    )


def test_the_sound_group_and_the_init_attributes_are_checked():
    """The sound group and the attributes __init__ must set are checked.

    A family with sound lacking a sound member, and one whose __init__ sets no transformer_config
    and no vae_config.
    """
    forgetful = without(LTX2Adapter, "decode_audio", "sampled_audio")
    with pytest.raises(TypeError, match="ForgetfulLTX2Adapter does not provide sampled_audio, decode_audio:"):
        check_family(forgetful)
    with pytest.raises(TypeError, match=r"WanAdapter does not provide transformer_config, vae_config:"):
        check_family(WanAdapter, WanAdapter.__new__(WanAdapter))


def test_every_registered_family_fills_the_contract():
    """And each key a family declares its own is a config key, named on the family's page in
    docs/models/."""
    keys = {
        f"{field.name}.{name}"
        for field in dataclasses.fields(Config)
        for name in typing.get_type_hints(field.type)
    }
    for family in ADAPTERS:
        cls = adapter_class(family)
        assert model_adapter.missing_members(cls) == [] and cls.FAMILY == family
        page = (REPO / "docs" / "models" / f"{family}.md").read_text()
        own = [*cls.OWN_KEYS, *cls.READS]
        assert [key for key in own if key not in keys or f"`{key}`" not in page] == [], family


def test_config_names_no_family():
    """A family is its file plus one registry line: config.py, the schema and the checks every
    family shares, names none of them (nor LTX, Wan, CogVideo), in code or comments."""
    text = (REPO / "config.py").read_text().lower()
    words = {*ADAPTERS, "ltx", "wan", "cogvideo"} | {
        name.removesuffix("Adapter").lower() for _, name in ADAPTERS.values()
    }
    named = {word for word in words if re.search(re.escape(word), text)}
    assert named == set(), f"config.py names {sorted(named)}: move the rule into the family's check_config"


def test_a_key_only_another_family_accepts_is_refused():
    """Every key a family owns, set in a run of each other family: refused by the family check, from
    the config alone (model.path does not exist), in a message naming the key and the owning family;
    the owner accepts it."""
    for owner in ADAPTERS:
        for key in [*adapter_class(owner).OWN_KEYS, *adapter_class(owner).READS]:
            value = other_value(key)
            for family in ADAPTERS:
                cfg = with_key(family, key, value)
                if key in adapter_class(family).OWN_KEYS or key in adapter_class(family).READS:
                    # STG and the added terms need their partners: LTX-2's own rules (a key
                    # several families read meets them in LTX-2's run, whoever lists it first)
                    if family == "ltx2":
                        cfg.validation.stg_scale, cfg.data.target_fps = 1.0, 24.0
                        cfg.model.type = "ic"  # IC-LoRA's keys: the type they shape
                    check_config(cfg)
                    continue
                with pytest.raises(ConfigError) as refused:
                    check_config(cfg)
                message = re.sub(r"[^a-z0-9]", "", str(refused.value).lower())
                assert key in str(refused.value) and owner in message, (
                    owner,
                    key,
                    family,
                    str(refused.value),
                )


def test_a_new_family_is_its_class_and_a_registry_line(monkeypatch):
    """A registered family without keys of its own refuses every family's keys, with the owner's
    message; one that declares a key accepts it; model.family is checked against the registry, every
    name listed."""
    monkeypatch.setitem(ADAPTERS, "plain", (__name__, "PlainAdapter"))
    monkeypatch.setitem(ADAPTERS, "dynamic", (__name__, "DynamicAdapter"))
    assert check_config(load_config(None, REQUIRED + ["--model.family", "plain"])) is PlainAdapter
    for key in ("validation.use_dynamic_cfg", "model.expert", "validation.stg_scale"):
        with pytest.raises(ConfigError, match=re.escape(key)):
            check_config(with_key("plain", key, other_value(key)))
    with pytest.raises(ConfigError, match=r"validation.use_dynamic_cfg is CogVideoX's pipeline option"):
        check_config(with_key("plain", "validation.use_dynamic_cfg", True))
    assert check_config(with_key("dynamic", "validation.use_dynamic_cfg", True)) is DynamicAdapter
    with pytest.raises(ConfigError) as unknown:
        check_config(load_config(None, REQUIRED + ["--model.family", "hunyuan"]))
    registered = ", ".join(f'"{family}"' for family in ADAPTERS)
    assert str(unknown.value) == (
        f'model.family = "hunyuan" is no family vidtrain trains: set one of {registered}, '
        'or "" for the family of model.path\'s pipeline'
    )
    assert '"plain", "dynamic"' in registered


def test_the_command_refuses_another_familys_key_before_the_cache_pass(write_config, tmp_path, caplog):
    """trainer.py's frame runs the family check on the config it read: nothing is read or written."""
    config = write_config(
        "foreign", **{"validation.stg_scale": 1.0, "data.cache_dir": str(tmp_path / "cache")}
    )
    with pytest.raises(SystemExit), caplog.at_level(logging.ERROR, logger="vidtrain"):
        trainer.main(["--cfg", str(config)])
    assert (
        "validation.stg_scale is an option of LTX-2's pipelines; cogvideox's pipeline has no such guidance "
        "term: remove it"
    ) in caplog.text
    assert not (tmp_path / "cache").exists() and not (tmp_path / "foreign").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_text_to_video_family_needs_no_image_encoder():
    """encode_image is required of a family that trains image-to-video (IMAGE, with "i2v" in
    TYPES), not of a text-only one."""
    text_only = type("TextOnly", (without(CogVideoXAdapter, "encode_image"),), {"TYPES": ("t2v",)})
    assert model_adapter.missing_members(text_only) == []
    assert model_adapter.missing_members(without(CogVideoXAdapter, "encode_image")) == ["encode_image"]


def test_several_text_encoders_are_cached_without_padding_and_given_back_with_masks():
    """encode_text may name several encoders' embeddings (HunyuanVideo 1.5: Qwen2.5-VL and ByT5):
    the cache keeps each prompt's rows without the padding and gives them back padded to the
    family's lengths, each with its mask; validation hands the family the same form. One encoder's
    text keeps its one tensor and no mask."""
    from validate import both_texts, prompt_text

    lengths = {"prompt_embeds": 6, "prompt_embeds_2": 4}
    embeds = {"prompt_embeds": torch.zeros(2, 6, 3), "prompt_embeds_2": torch.zeros(2, 4, 5)}
    embeds["prompt_embeds"][0, :2], embeds["prompt_embeds"][1, :5] = 1.0, 2.0
    embeds["prompt_embeds_2"][0, :3], embeds["prompt_embeds_2"][1, :1] = 3.0, 4.0
    stored = {name: model_adapter.unpadded(embed[1]) for name, embed in embeds.items()}
    assert {name: len(rows) for name, rows in stored.items()} == {"prompt_embeds": 5, "prompt_embeds_2": 1}
    batch = model_adapter.padded_text(stored, lengths)
    assert torch.equal(batch["prompt_embeds"], embeds["prompt_embeds"][1])
    assert torch.equal(batch["prompt_embeds_2"], embeds["prompt_embeds_2"][1])
    assert batch["prompt_embeds_mask"].tolist() == [True] * 5 + [False]
    assert batch["prompt_embeds_2_mask"].tolist() == [True, False, False, False]
    first = prompt_text(embeds, 0, lengths)
    assert first["prompt_embeds_mask"].tolist() == [[True, True, False, False, False, False]]
    assert torch.equal(first["prompt_embeds_2"], embeds["prompt_embeds_2"][:1])
    guided = both_texts(first, prompt_text(embeds, 1, lengths))
    assert {name: tuple(t.shape) for name, t in guided.items()} == {
        "prompt_embeds": (2, 6, 3),
        "prompt_embeds_mask": (2, 6),
        "prompt_embeds_2": (2, 4, 5),
        "prompt_embeds_2_mask": (2, 4),
    }
    one = torch.zeros(2, 6, 3)
    one[0, :2] = 1.0
    assert model_adapter.padded_text({"prompt_embeds": model_adapter.unpadded(one[0])}, 6).keys() == {
        "prompt_embeds"
    }
    assert torch.equal(prompt_text(one, 0, 6), one[:1])
