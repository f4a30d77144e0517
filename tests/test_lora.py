"""lora.py against PEFT and diffusers: numerics, export/import, merge, seeding, dropout."""

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import lora  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
RANK, ALPHA = 4, 2.0  # alpha != rank: a loader that assumes alpha = rank gets twice the strength


class Toy(nn.Module):
    """Names like an attention block: `to_q` and `to_out.0` are targets, `proj` is not."""

    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 32)
        self.to_out = nn.Sequential(nn.Linear(32, 8), nn.Dropout(0.0))

    def forward(self, x):
        return self.to_out(self.proj(torch.tanh(self.to_q(x))))


def toy(seed=0) -> Toy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Toy()


def randomize_lora_B(model, seed=1):
    """B starts at zero; random B makes the LoRA path visible in every output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module")
def tiny_dir(tiny_models):
    return str(tiny_models("5b"))  # rotary embeddings: the LoRA targets see them


def load_transformer(tiny_dir):
    from diffusers import CogVideoXTransformer3DModel

    return CogVideoXTransformer3DModel.from_pretrained(tiny_dir, subfolder="transformer").eval()


def transformer_inputs(transformer):
    cfg = transformer.config
    gen = torch.Generator().manual_seed(123)
    frames = (cfg.sample_frames - 1) // cfg.temporal_compression_ratio + 1
    return dict(
        hidden_states=torch.randn(
            1, frames, cfg.in_channels, cfg.sample_height, cfg.sample_width, generator=gen
        ),
        encoder_hidden_states=torch.randn(1, cfg.max_text_seq_length, cfg.text_embed_dim, generator=gen),
        timestep=torch.tensor([500]),
        return_dict=False,
    )


@pytest.fixture(scope="module")
def lora_transformer(tiny_dir):
    """The tiny transformer with LoRA on attention, random nonzero B, and its reference output."""
    model = load_transformer(tiny_dir)
    lora.inject_lora(model, TARGETS, RANK, ALPHA, dropout=0.0, seed=0)
    randomize_lora_B(model)
    inputs = transformer_inputs(model)
    with torch.no_grad():
        out = model(**inputs)[0]
    return model, inputs, out


def test_matches_peft_outputs_and_grads():
    from peft import LoraConfig, inject_adapter_in_model

    ours, theirs = toy(), toy()
    names = lora.inject_lora(ours, ["to_q", "to_out.0"], RANK, ALPHA, dropout=0.0, seed=0)
    assert names == ["to_out.0", "to_q"]
    randomize_lora_B(ours)
    theirs = inject_adapter_in_model(
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q", "to_out.0"]), theirs
    )
    with torch.no_grad():
        for name in names:
            layer = theirs.get_submodule(name)
            layer.lora_A["default"].weight.copy_(ours.get_submodule(name).lora_A.weight)
            layer.lora_B["default"].weight.copy_(ours.get_submodule(name).lora_B.weight)

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb, atol=1e-6, rtol=0)
    (ya**2).sum().backward()
    (yb**2).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-6, rtol=0)
    for name in names:
        for part in ("lora_A", "lora_B"):
            ga = getattr(ours.get_submodule(name), part).weight.grad
            gb = getattr(theirs.get_submodule(name), part)["default"].weight.grad
            assert ga.abs().sum() > 0
            torch.testing.assert_close(ga, gb, atol=1e-6, rtol=0)


def test_diffusers_pipeline_loads_our_file(tiny_dir, lora_transformer, tmp_path):
    from diffusers import CogVideoXPipeline

    model, inputs, expected = lora_transformer
    path = str(tmp_path / "pytorch_lora_weights.safetensors")
    lora.save_lora(path, lora.lora_state_dict(model), RANK, ALPHA, TARGETS)

    pipe = CogVideoXPipeline.from_pretrained(tiny_dir)
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(path)
        loaded = pipe.transformer(**inputs)[0]
    assert (expected - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=0)

    # The same weights without metadata load at alpha = rank: the check above has teeth.
    bare = str(tmp_path / "bare.safetensors")
    with safe_open(path, framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, bare)
    pipe.unload_lora_weights()
    with torch.no_grad():
        pipe.load_lora_weights(bare)
        wrong = pipe.transformer(**inputs)[0]
    assert (wrong - expected).abs().max() > 1e-3


def test_file_is_what_diffusers_writes(lora_transformer, tmp_path):
    from diffusers import CogVideoXPipeline

    model, _, _ = lora_transformer
    sd = lora.lora_state_dict(model)
    ours = str(tmp_path / "ours.safetensors")
    lora.save_lora(ours, sd, RANK, ALPHA, TARGETS)
    with safe_open(ours, framework="pt") as f:
        header = f.metadata()
    packed = json.loads(header["lora_adapter_metadata"])
    assert packed["transformer.r"] == RANK and packed["transformer.lora_alpha"] == ALPHA
    config = {k.removeprefix("transformer."): v for k, v in packed.items()}
    CogVideoXPipeline.save_lora_weights(
        str(tmp_path / "diffusers"), transformer_lora_layers=sd, transformer_lora_adapter_metadata=config
    )
    # Not byte for byte: safetensors writes the metadata map in hash order, which varies per
    # process.
    with safe_open(tmp_path / "diffusers" / "pytorch_lora_weights.safetensors", framework="pt") as f:
        assert f.metadata() == header
        theirs = {k: f.get_tensor(k) for k in f.keys()}
    assert theirs.keys() == {"transformer." + k for k in sd}
    assert all(torch.equal(theirs["transformer." + k], v) and v.dtype == torch.float32 for k, v in sd.items())


def test_merged_state_dict(tiny_dir, lora_transformer):
    model, inputs, expected = lora_transformer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = lora.merged_state_dict(model)
    plain = load_transformer(tiny_dir)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs)[0], expected, atol=1e-5, rtol=0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A copy: mutating it must not reach the model.
    next(iter(merged.values())).add_(1.0)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_round_trip_and_errors(tmp_path):
    model = toy()
    lora.inject_lora(model, ["to_q", "to_out.0"], RANK, ALPHA, dropout=0.0, seed=0)
    randomize_lora_B(model)
    sd = lora.lora_state_dict(model)
    assert sorted(sd) == [f"{m}.lora_{p}.weight" for m in ("to_out.0", "to_q") for p in "AB"]
    assert all(v.dtype == torch.float32 and not v.requires_grad for v in sd.values())
    path = str(tmp_path / "sub" / "pytorch_lora_weights.safetensors")
    lora.save_lora(path, sd, RANK, ALPHA, ["to_q", "to_out.0"])
    # no .tmp left behind
    assert os.listdir(tmp_path / "sub") == ["pytorch_lora_weights.safetensors"]

    loaded, info = lora.load_lora(path)
    assert info == {"rank": RANK, "alpha": ALPHA, "target_modules": ["to_out.0", "to_q"]}
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)

    fresh = toy()
    lora.inject_lora(fresh, info["target_modules"], info["rank"], info["alpha"], dropout=0.0, seed=7)
    lora.load_lora_into(fresh, loaded)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), atol=0, rtol=0)

    with pytest.raises(ValueError, match="missing.*to_q.lora_A.weight"):
        lora.load_lora_into(fresh, {k: v for k, v in loaded.items() if not k.startswith("to_q.lora_A")})
    with pytest.raises(ValueError, match="unexpected.*proj.lora_A.weight"):
        lora.load_lora_into(fresh, loaded | {"proj.lora_A.weight": torch.zeros(RANK, 32)})
    with pytest.raises(ValueError, match="shape"):
        lora.load_lora_into(fresh, loaded | {"to_q.lora_A.weight": torch.zeros(1, 16)})
    with pytest.raises(ValueError, match=r"\['to_nothing', 'out.1'\] match no nn.Linear"):
        lora.inject_lora(toy(), ["to_q", "to_nothing", "out.1"], RANK, ALPHA, dropout=0.0, seed=0)
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.inject_lora(model, ["proj"], RANK, ALPHA, dropout=0.0, seed=0)

    bare = str(tmp_path / "bare.safetensors")
    save_file({"transformer." + k: v for k, v in sd.items()}, bare)
    with pytest.raises(ValueError, match=f"{bare}.*lora_adapter_metadata.*alpha is unknown"):
        lora.load_lora(bare)
    dora = str(tmp_path / "dora.safetensors")
    meta = {"transformer.r": RANK, "transformer.lora_alpha": ALPHA, "transformer.target_modules": ["to_q"]}
    meta["transformer.use_dora"] = True
    save_file(
        {"transformer." + k: v for k, v in sd.items()}, dora, {"lora_adapter_metadata": json.dumps(meta)}
    )
    with pytest.raises(ValueError, match=r"\['use_dora'\]"):
        lora.load_lora(dora)


def test_init_is_seeded_and_leaves_global_rng_alone():
    def injected(seed):
        model = toy()
        lora.inject_lora(model, ["to_q", "to_out.0", "proj"], RANK, ALPHA, dropout=0.0, seed=seed)
        return model

    state = torch.get_rng_state()
    a, b, c = injected(0), injected(0), injected(1)
    assert torch.equal(torch.get_rng_state(), state)

    sa, sb, sc = lora.lora_state_dict(a), lora.lora_state_dict(b), lora.lora_state_dict(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for k in sa:
        if "lora_A" in k:
            assert not torch.equal(sa[k], sc[k])
            # kaiming_uniform(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1 / sa[k].shape[1] ** 0.5
            assert sa[k].abs().max() <= bound and sa[k].std() > bound / 3
        else:
            assert not sa[k].any()
    # B = 0: at initialisation the model computes exactly what the base did.
    x = torch.randn(2, 16)
    torch.testing.assert_close(a(x), toy()(x), atol=0, rtol=0)
    trainable = sorted(n for n, p in a.named_parameters() if p.requires_grad)
    assert trainable == sorted(sa)
    assert a.to_q.weight is a.to_q.weight and "to_q.weight" in a.state_dict()


def test_peft_adapter_export(tiny_dir, lora_transformer, tmp_path):
    from peft import PeftModel

    model, inputs, expected = lora_transformer
    lora.save_peft_adapter(str(tmp_path), lora.lora_state_dict(model), RANK, ALPHA, TARGETS)
    peft_model = PeftModel.from_pretrained(load_transformer(tiny_dir), str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**inputs)[0], expected, atol=1e-5, rtol=0)


def test_dropout_uses_its_generator():
    model = toy()
    lora.inject_lora(model, ["to_q", "to_out.0"], RANK, ALPHA, dropout=0.5, seed=0)
    randomize_lora_B(model)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="set_dropout_generator"):
        model(x)

    def run(seed):
        lora.set_dropout_generator(model, torch.Generator().manual_seed(seed))
        return model(x)

    state = torch.get_rng_state()
    y1, y2, y3 = run(5), run(5), run(6)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    assert not torch.allclose(y1, y3)
    model.eval()  # no dropout, no generator needed
    lora.set_dropout_generator(model, None)
    assert not torch.allclose(model(x), y1)

    # Inverted dropout on A's input, as nn.Dropout in PEFT: the mask is the generator's next draw.
    layer = model.to_q.train()
    layer.dropout_generator = torch.Generator().manual_seed(9)
    keep = torch.empty_like(x).bernoulli_(0.5, generator=torch.Generator().manual_seed(9))
    lora_out = layer.lora_B(layer.lora_A(x * keep / 0.5)) * layer.scale
    expected = nn.functional.linear(x, layer.weight, layer.bias) + lora_out
    torch.testing.assert_close(layer(x), expected, atol=1e-6, rtol=0)


def test_bf16_base_with_fp32_lora():
    reference = toy()
    lora.inject_lora(reference, ["to_q", "to_out.0"], RANK, ALPHA, dropout=0.0, seed=0)
    randomize_lora_B(reference)
    # The trainer's build order: frozen weights in bf16 first, then injection.
    model = toy().to(torch.bfloat16)
    lora.inject_lora(model, ["to_q", "to_out.0"], RANK, ALPHA, dropout=0.0, seed=0)
    lora.load_lora_into(model, lora.lora_state_dict(reference))
    assert model.to_q.weight.dtype == torch.bfloat16 and model.to_q.lora_A.weight.dtype == torch.float32
    x = torch.randn(4, 16)
    expected = reference(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    y_plain = model(x.bfloat16())  # no autocast: the LoRA path runs in fp32, the output in bf16
    assert y_plain.dtype == torch.bfloat16
    for out in (y, y_plain):
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
