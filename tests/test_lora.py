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
    assert info == {
        "rank": RANK,
        "alpha": ALPHA,
        "target_modules": ["to_out.0", "to_q"],
        "variant": "lora",
        "factor": -1,
    }
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
    rslora = str(tmp_path / "rslora.safetensors")
    meta = {"transformer.r": RANK, "transformer.lora_alpha": ALPHA, "transformer.target_modules": ["to_q"]}
    meta["transformer.use_rslora"] = True
    save_file(
        {"transformer." + k: v for k, v in sd.items()}, rslora, {"lora_adapter_metadata": json.dumps(meta)}
    )
    with pytest.raises(ValueError, match=r"\['use_rslora'\]"):
        lora.load_lora(rslora)


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


# DoRA and LoKr (lora.variant)


def randomize_parts(model, seed=1):
    """Every adapter tensor random: the zero-started ones (B, w2_b, w2) and DoRA's m away from ||W||."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_magnitude_vector"):
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_dora_matches_peft_outputs_grads_and_merge():
    """DoRA against PEFT's use_dora: m starts at ||W||, then outputs, gradients and merge agree."""
    from peft import LoraConfig, inject_adapter_in_model

    ours = toy()
    names = lora.inject_lora(ours, ["to_q", "to_out.0"], RANK, ALPHA, 0.0, 0, variant="dora")
    theirs = inject_adapter_in_model(
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q", "to_out.0"], use_dora=True), toy()
    )
    for name in names:
        start = theirs.get_submodule(name).lora_magnitude_vector["default"].weight
        torch.testing.assert_close(ours.get_submodule(name).lora_magnitude_vector, start, atol=0, rtol=0)
    randomize_parts(ours)
    with torch.no_grad():
        for name in names:
            a, b = ours.get_submodule(name), theirs.get_submodule(name)
            b.lora_A["default"].weight.copy_(a.lora_A.weight)
            b.lora_B["default"].weight.copy_(a.lora_B.weight)
            b.lora_magnitude_vector["default"].weight.copy_(a.lora_magnitude_vector)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    ya, yb = ours(x), theirs(x)
    torch.testing.assert_close(ya, yb, atol=1e-6, rtol=0)
    (ya**2).sum().backward()
    (yb**2).sum().backward()
    for name in names:
        a, b = ours.get_submodule(name), theirs.get_submodule(name)
        for mine, peft_param in (
            (a.lora_A.weight, b.lora_A["default"].weight),
            (a.lora_B.weight, b.lora_B["default"].weight),
            (a.lora_magnitude_vector, b.lora_magnitude_vector["default"].weight),
        ):
            assert mine.grad.abs().sum() > 0
            torch.testing.assert_close(mine.grad, peft_param.grad, atol=1e-6, rtol=1e-5)
    merged = lora.merged_state_dict(ours)
    for name in names:
        theirs.get_submodule(name).merge()
        torch.testing.assert_close(merged[f"{name}.weight"], theirs.get_submodule(name).base_layer.weight)


def test_dora_file_loads_in_diffusers_peft_and_ours(tiny_dir, tmp_path):
    """Our DoRA file through load_lora_weights (PEFT's use_dora underneath), PeftModel and our reader."""
    from diffusers import CogVideoXPipeline
    from peft import PeftModel

    import model as model_module
    from config import ConfigError, LoraConfig

    model = load_transformer(tiny_dir)
    lora.inject_lora(model, TARGETS, RANK, ALPHA, 0.0, 0, variant="dora")
    randomize_parts(model)
    inputs = transformer_inputs(model)
    sd = lora.lora_state_dict(model)
    assert sum(k.endswith(".lora_magnitude_vector") for k in sd) == len(sd) // 3
    path = str(tmp_path / "pytorch_lora_weights.safetensors")
    lora.save_lora(path, sd, RANK, ALPHA, TARGETS, variant="dora")
    lora.save_peft_adapter(str(tmp_path / "peft"), sd, RANK, ALPHA, TARGETS, variant="dora")
    pipe = CogVideoXPipeline.from_pretrained(tiny_dir)
    plain = load_transformer(tiny_dir)
    plain.load_state_dict(lora.merged_state_dict(model))
    with torch.no_grad():
        expected = model(**inputs)[0]
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(path)
        assert (expected - base).abs().max() > 1e-3
        torch.testing.assert_close(pipe.transformer(**inputs)[0], expected, atol=1e-5, rtol=0)
        peft_model = PeftModel.from_pretrained(load_transformer(tiny_dir), str(tmp_path / "peft"))
        torch.testing.assert_close(peft_model(**inputs)[0], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(plain(**inputs)[0], expected, atol=1e-5, rtol=0)  # the merge

    # lora.init_from and --lora: our file and PEFT's, back to the same layers
    for source in (path, str(tmp_path / "peft")):
        weights, info = lora.load_lora(source)
        assert info["variant"] == "dora"
        fresh = load_transformer(tiny_dir)
        lora.inject_lora(fresh, TARGETS, RANK, ALPHA, 0.0, 7, variant="dora")
        lora.load_lora_into(fresh, weights)
        with torch.no_grad():
            torch.testing.assert_close(fresh(**inputs)[0], expected, atol=0, rtol=0)
    with pytest.raises(ConfigError, match="variant 'dora', but lora.variant = 'lora'"):
        model_module.check_lora_matches(LoraConfig(rank=RANK, lora_alpha=ALPHA, target_modules=TARGETS), info)


def lycoris_factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' factorization, as written at KohakuBlueleaf/LyCORIS
    f49d30d670591ec8841d241d79aaa8449b30a715, lycoris/functional/general.py:14-56 (its docstring's
    table is not what the loop returns for 360: the loop gives (18, 20))."""
    if factor > 0 and (dimension % factor) == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def lycoris_delta(layer) -> torch.Tensor:
    """LyCORIS' LoKr weight difference for a linear layer's factors, at the same commit:
    lycoris/functional/lokr.py diff_weight (124-151) and make_kron (11-20): kron(w1, w2) * gamma / r
    with w2 = w2_a @ w2_b of rank r = w2_a.shape[1]; with a full w2 r = gamma, a scale of 1 (also
    lycoris/modules/lokr.py:206-217, alpha = lora_dim when both factors are full)."""
    gamma = layer.alpha
    w2 = getattr(layer, "lokr_w2", None)
    if w2 is None:
        rank = layer.lokr_w2_a.shape[1]
        w2 = layer.lokr_w2_a @ layer.lokr_w2_b
    else:
        rank = gamma
    return torch.kron(layer.lokr_w1, w2) * (gamma / rank)


def test_lokr_matches_lycoris():
    """LoKr against LyCORIS' formula: factor shapes, the layer's output and gradients, the merge."""
    for dimension in (1, 7, 16, 32, 127, 128, 250, 360, 1024, 3072, 5120):
        for factor in (-1, 1, 2, 4, 5, 8, 16, 20):
            assert lora.factorization(dimension, factor) == lycoris_factorization(dimension, factor)

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    # to_q 16 -> 32: out 4 x 8, in 4 x 4, so w2 is [8, 4]: rank 2 < 8 / 2 factors it. to_out.0 32 -> 8:
    # w2 [4, 8], rank 4 is not below 8 / 2: a full w2 at scale 1. proj 32 -> 32 at factor 2: w1
    # [2, 2], w2 [16, 16] of rank 2.
    cases = [
        ("to_q", 2, -1, (4, 4), "lokr_w2_a"),
        ("to_out.0", 4, -1, (2, 4), "lokr_w2"),
        ("proj", 2, 2, (2, 2), "lokr_w2_a"),
    ]
    for name, rank, factor, w1_shape, w2_part in cases:
        model, reference = toy(), toy()
        lora.inject_lora(model, [name], rank, 3.0, 0.0, 0, variant="lokr", factor=factor)
        layer = model.get_submodule(name)
        assert layer.lokr_w1.shape == w1_shape and w2_part in layer.parts
        assert layer.scale == (1.0 if w2_part == "lokr_w2" else 3.0 / rank)
        with torch.no_grad():  # LyCORIS starts w2_b (or w2) at zero: the base model
            torch.testing.assert_close(model(x), reference(x), atol=0, rtol=0)
        randomize_parts(model)
        y = model(x)
        y.square().sum().backward()
        grads = {key: p.grad.clone() for key, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        # LyCORIS' merged weight in the reference's layer (its non-bypass forward), from our factors
        hook = reference.get_submodule(name).register_forward_hook(
            lambda m, args, out: nn.functional.linear(args[0], m.weight + lycoris_delta(layer), m.bias)
        )
        expected = reference(x)
        hook.remove()
        torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
        expected.square().sum().backward()
        assert len(grads) == len(layer.parts)
        for key, grad in grads.items():
            assert grad.abs().sum() > 0
            torch.testing.assert_close(grad, model.get_parameter(key).grad, atol=1e-5, rtol=1e-5)
        weight = reference.get_submodule(name).weight + lycoris_delta(layer)
        merged = lora.merged_state_dict(model)[f"{name}.weight"]
        torch.testing.assert_close(merged, weight.detach(), atol=1e-6, rtol=0)


def comfyui_load_lora(lora_sd: dict, to_load: dict) -> tuple[dict, set]:
    """ComfyUI's key matching for the parts we write: comfy/lora.py load_lora at
    comfyanonymous/ComfyUI 41444b5236c613ee5ff7d09aa620f94b702f30eb (alpha, dora_scale, the
    diffusers2 lora_B/lora_A names, the lokr_* names). Returns the patches and the keys it loaded;
    any other key it logs as "lora key not loaded"."""
    patches, loaded = {}, set()
    for x, weight_key in to_load.items():
        found = {k.removeprefix(x + "."): lora_sd[k] for k in lora_sd if k.startswith(x + ".")}
        known = {"alpha", "dora_scale", "lora_A.weight", "lora_B.weight", "lokr_w1", "lokr_w2"}
        known |= {"lokr_w2_a", "lokr_w2_b"}
        loaded |= {f"{x}.{part}" for part in found if part in known}
        alpha = found["alpha"].item() if "alpha" in found else None
        if "lora_B.weight" in found:
            patches[weight_key] = ("lora", found["lora_B.weight"], found["lora_A.weight"], alpha)
        if any(part.startswith("lokr") for part in found):
            parts = (found.get(p) for p in ("lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b"))
            patches[weight_key] = ("lokr", *parts, alpha)
        if weight_key in patches:
            patches[weight_key] += (found.get("dora_scale"),)
    return patches, loaded


def comfyui_weight_decompose(dora_scale, weight, lora_diff, alpha, norm_of_patched):
    """comfy/weight_adapter/base.py weight_decompose at 9c0cf36cd7964978850fd40f8cf76ac2cf9f9e15,
    strength 1, float32. A dora_scale [out, 1] takes its output-axis branch, which divides by
    ||W||, the base's norm; Comfy-Org/ComfyUI#15458 (open) divides by ||W + diff||, as DoRA, LyCORIS
    and its own input-axis branch do: `norm_of_patched` picks that."""
    weight_calc = weight + lora_diff * alpha
    assert dora_scale.shape[0] == weight_calc.shape[0]  # the output-axis branch
    weight_norm = (weight_calc if norm_of_patched else weight).norm(dim=1, keepdim=True)
    return weight_calc * (dora_scale / (weight_norm + torch.finfo(weight.dtype).eps))


def comfyui_patched(patch, weight, norm_of_patched=True):
    """comfy/weight_adapter/lora.py LoRAAdapter.calculate_weight (6fd406fb14ca663225b88c6f75d7a7f2b997e5a0)
    and comfy/weight_adapter/lokr.py LoKrAdapter.calculate_weight
    (179c2d35c84beb3d9761fcd146ffcba77273413e), linear layers, strength 1."""
    kind, *v, dora_scale = patch
    if kind == "lora":
        up, down, alpha = v
        scale, diff = (alpha / down.shape[0] if alpha is not None else 1.0), up @ down
    else:
        w1, w2, w2_a, w2_b, alpha = v
        dim = None if w2 is not None else w2_b.shape[0]
        w2 = w2 if w2 is not None else w2_a @ w2_b
        scale, diff = (alpha / dim if alpha is not None and dim is not None else 1.0), torch.kron(w1, w2)
    if dora_scale is not None:
        return comfyui_weight_decompose(dora_scale, weight, diff, scale, norm_of_patched)
    return weight + scale * diff


# LoKr at rank 4: a full lokr_w2 on the tiny model's 32 x 32 layers (w2 [8, 8]), at scale 1
@pytest.mark.parametrize("variant, rank", [("dora", 2), ("lokr", 2), ("lokr", 4)])
def test_comfy_export_of_dora_and_lokr_as_comfyui_patches_it(variant, rank, tiny_dir, tmp_path):
    """Every key of the ComfyUI file is one ComfyUI's loader takes, and its formulas give our merge.

    DoRA: equal with the normalisation of Comfy-Org/ComfyUI#15458; ComfyUI's release divides by
    ||W|| instead, off by ||W + s B A|| / ||W|| per row (docs/training.md)."""
    from conftest import comfyui_linears

    import ckpt
    import model as model_module
    from config import ConfigError, LoraConfig, ModelConfig
    from model_adapter import load_adapter

    adapter = load_adapter(ModelConfig(path=tiny_dir), torch.device("cpu"))
    model = load_transformer(tiny_dir)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    names = lora.inject_lora(model, targets, rank, 3.0, 0.0, 0, variant=variant)
    randomize_parts(model)
    weights = lora.lora_state_dict(model)
    assert any(k.endswith(".lokr_w2") for k in weights) == ((variant, rank) == ("lokr", 4))
    ckpt._export_comfy(weights, 3.0, adapter, tmp_path / "lora", "run")
    path = tmp_path / "lora" / "comfy" / "run.safetensors"
    with safe_open(path, framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    # comfy/lora.py model_lora_keys_unet: "diffusion_model.<module>" for each weight of the model
    to_load = {
        f"diffusion_model.{m}": f"diffusion_model.{m}.weight"
        for m in comfyui_linears(adapter.transformer_config)
    }
    patches, loaded = comfyui_load_lora(written, to_load)
    assert loaded == written.keys()  # no "lora key not loaded"
    assert len(patches) == len(names)
    for weight_key, patch in patches.items():
        name = adapter.diffusers_key(weight_key.removeprefix("diffusion_model.").removesuffix(".weight"))
        layer = model.get_submodule(name)
        theirs = comfyui_patched(patch, layer.weight.detach())
        torch.testing.assert_close(theirs, layer.merged_weight(), atol=2e-6, rtol=0)
        if variant == "dora":
            released = comfyui_patched(patch, layer.weight.detach(), norm_of_patched=False)
            merged = layer.weight.detach() + layer.delta_weight()
            ratio = merged.norm(dim=1, keepdim=True) / layer.weight.detach().norm(dim=1, keepdim=True)
            torch.testing.assert_close(released, layer.merged_weight() * ratio, atol=2e-6, rtol=0)
            assert (ratio - 1).abs().max() > 1e-3
    # the ComfyUI layout is read back for plain LoRA only: a DoRA or LoKr one is refused by name
    with pytest.raises(ValueError, match="is a DoRA or LoKr in ComfyUI's layout"):
        lora.load_lora(str(path), adapter.diffusers_key)
    # our own file of a LoKr carries its variant and factor, which lora.init_from must match
    lora.save_lora(
        str(tmp_path / "ours.safetensors"), weights, rank, 3.0, targets, variant=variant, factor=-1
    )
    read, info = lora.load_lora(str(tmp_path / "ours.safetensors"))
    assert info["variant"] == variant and read.keys() == weights.keys()
    ours = LoraConfig(rank=rank, lora_alpha=3.0, target_modules=targets, variant=variant)
    model_module.check_lora_matches(ours, info)
    if variant == "lokr":
        with pytest.raises(ConfigError, match="factor -1, but lora.lokr_factor = 4"):
            model_module.check_lora_matches(LoraConfig(**{**vars(ours), "lokr_factor": 4}), info)


@pytest.mark.parametrize("variant", ["dora", "lokr"])
def test_dora_and_lokr_on_an_fp8_base(variant):
    """model.storage_dtype = "fp8": DoRA's m starts from the upcast rows, and each variant computes
    and merges what it does on a plain layer holding the upcast weight."""
    import memory

    base = nn.Linear(32, 16)
    weight, scale = memory.quantize(base.weight.detach())
    fp8 = nn.Sequential(memory.Fp8Linear(weight, scale, base.bias.detach(), torch.float32))
    plain = nn.Sequential(nn.Linear(32, 16))
    with torch.no_grad():
        plain[0].weight.copy_(memory.dequantize(weight, scale, torch.float32))
        plain[0].bias.copy_(base.bias)
    for model in (fp8, plain):
        lora.inject_lora(model, ["0"], 2, 3.0, 0.0, 0, variant=variant)
        randomize_parts(model)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fp8(x), plain(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(fp8[0].merged_weight(), plain[0].merged_weight(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ["dora", "lokr"])
def test_export_writes_each_variants_files(variant, tiny_dir, tmp_path):
    """The final export of a DoRA: our file, PEFT's adapter and ComfyUI's; of a LoKr: ours and
    ComfyUI's, no PEFT adapter (PEFT's LoKr scales a full w2 otherwise). Ours reads back."""
    from conftest import one_rank_group

    import ckpt
    from config import LoraConfig, ModelConfig
    from model_adapter import load_adapter

    adapter = load_adapter(ModelConfig(path=tiny_dir), torch.device("cpu"))
    model = load_transformer(tiny_dir)
    lora.inject_lora(model, TARGETS, RANK, ALPHA, 0.0, 0, variant=variant)
    randomize_parts(model)
    cfg = LoraConfig(rank=RANK, lora_alpha=ALPHA, target_modules=TARGETS, variant=variant)
    with one_rank_group() as d:
        ckpt.export(model, "lora", cfg, adapter, str(tmp_path), d, name="run")
    folder = tmp_path / "lora"
    assert (folder / "adapter_model.safetensors").is_file() == (variant == "dora")
    assert (folder / "comfy" / "run.safetensors").is_file()
    weights, info = lora.load_lora(str(folder / "pytorch_lora_weights.safetensors"))
    assert info["variant"] == variant and weights.keys() == lora.lora_state_dict(model).keys()


def test_dora_norm_is_fp32_under_autocast(monkeypatch):
    """Under bf16 autocast DoRA's norm is still that of W + s B A in fp32 (autocast would round the
    product B @ A to bf16)."""
    model = toy()
    lora.inject_lora(model, ["to_q"], RANK, ALPHA, 0.0, 0, variant="dora")
    randomize_parts(model)
    seen, norm = [], torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, **kw: seen.append(t) or norm(t, **kw))
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randn(2, 16))
    layer = model.to_q
    expected = layer.weight + layer.scale * (layer.lora_B.weight @ layer.lora_A.weight)
    assert len(seen) == 1 and seen[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], expected.detach(), atol=1e-7, rtol=0)
