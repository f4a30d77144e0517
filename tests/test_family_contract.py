"""The family contract: what a family lacks is named when it loads; the three families fill it.

The family contract (model_adapter.Adapter): a family that leaves out part of it is named, with what
it lacks, when it is loaded, not by an AttributeError mid-run; the three families fill it."""

import sys

import pytest
import torch

import model_adapter
from config import ModelConfig
from families.ltx2 import LTX2Adapter
from families.wan import WanAdapter
from model_adapter import ADAPTERS, Adapter, adapter_class, check_family, load_adapter


def without(family: type[Adapter], *names: str) -> type[Adapter]:
    """A copy of a family's adapter class, defined on Adapter directly, that forgets `names`."""
    own = ("__dict__", "__weakref__", "__module__", "__qualname__")
    namespace = {k: v for k, v in vars(family).items() if k not in names + own}
    return type(f"Forgetful{family.__name__}", (Adapter,), {**namespace, "__module__": __name__})


ForgetfulWanAdapter = without(WanAdapter, "sampling_step")  # module-level: ADAPTERS names classes by module


def test_a_family_that_forgets_a_required_method_is_named_at_load(monkeypatch):
    """A family that forgets a required method is named when it loads.

    load_adapter stops before reading the model folder, in one message naming the class and member.
    """
    monkeypatch.setitem(ADAPTERS, "wan", (__name__, "ForgetfulWanAdapter"))
    with pytest.raises(TypeError) as error:
        load_adapter(ModelConfig(family="wan", path="/nowhere"), torch.device("cpu"))
    assert str(error.value) == (f"the family adapter {__name__}.ForgetfulWanAdapter does not provide "
                                "sampling_step: every family defines them (model_adapter.Adapter declares "
                                "each, docs/adding-a-family.md lists them)")


def test_the_sound_group_and_the_init_attributes_are_checked():
    """The sound group and the attributes __init__ must set are checked.

    A family with sound lacking a sound member, and one whose __init__ sets no transformer_config.
    """
    forgetful = without(LTX2Adapter, "decode_audio", "sampled_audio")
    with pytest.raises(TypeError, match="ForgetfulLTX2Adapter does not provide sampled_audio, decode_audio:"):
        check_family(forgetful)
    with pytest.raises(TypeError, match=r"WanAdapter does not provide transformer_config:"):
        check_family(WanAdapter, WanAdapter.__new__(WanAdapter))


def test_every_registered_family_fills_the_contract():
    for family in ADAPTERS:
        cls = adapter_class(family)
        assert model_adapter.missing_members(cls) == [] and cls.FAMILY == family


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
