"""train.optimizer: every optimizer resumes bitwise on 2 ranks; the arguments' checks; Muon's split;
LoRA+'s groups.

The resume test is one torchrun launch of 2 ranks: for each optimizer, LoRA and sft, a tiny CogVideoX
built by model.build_model (FSDP2) and model.build_optimizer steps through trainer.clip_and_step,
saves with ckpt.Checkpointer (DCP) after step 2 and goes on to step 4; a fresh build resumes the
checkpoint, steps 3 and 4 again and must end bitwise where the first did; an FSDP2 checkpoint also
loads resharded into a DDP build (the same weights, the same optimizer state entries). Adafactor and
prodigy step whole weights under FSDP2 (model.WholeWeights): their 4 steps from a DDP build, with the
libraries' own classes, end where FSDP2's did. torchao compiles
AdamW8bit's step with inductor, which takes a minute on these CPUs: the worker runs it eagerly
(TORCHDYNAMO_DISABLE), the same arithmetic."""

import importlib.util
import json

import pytest
import torch
from conftest import run_worker

import model
from config import ConfigError, LoraConfig, TrainConfig

OPTIMIZERS = ("adamw", "adafactor", "muon", "prodigy", "adamw8bit")

WORKER = r"""
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import ckpt, command, data, ranks, trainer
from config import CheckpointConfig, LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from model import WHOLE_WEIGHT_STEPS, LossScaler, ProdigyCounters, build_model, build_optimizer
from model_adapter import load_adapter

dist.init_process_group("gloo")
rank = dist.get_rank()
d = ranks.Dist(rank, 2, rank, torch.device("cpu"))
adapter = load_adapter(ModelConfig(path=sys.argv[2], family="cogvideox", dtype="fp32"), d.device)
# rank 256: each rank's shard of a LoRA matrix holds 4096 values (256 x 32 / 2), the least that torchao
# keeps in 8 bits (smaller tensors keep fp32 moments)
lora = LoraConfig(rank=256, lora_alpha=256, plus_ratio=4.0)
g = torch.Generator().manual_seed(rank)
latents = (1, adapter.latent_channels, 3, 8, 8)
batches = [{"latent_mean": torch.randn(latents, generator=g), "latent_logvar": torch.randn(latents, generator=g) - 4,
            "prompt_embeds": torch.randn(1, adapter.text_length, adapter.transformer_config["text_embed_dim"],
                                         generator=g)} for _ in range(4)]


def build(t, parallel="fsdp"):
    m = build_model(adapter, t, lora, ParallelConfig(strategy=parallel), 0, d)
    # LoRA+ but for prodigy, which refuses it (model.check_optimizer)
    plus = lora.plus_ratio if t.training_type == "lora" and t.optimizer != "prodigy" else 0.0
    params, optimizer = build_optimizer(m, t, plus)
    state = trainer.TrainState(d.device)
    objects = {"model": m, "optimizer": optimizer, "train": state}
    objects |= {"prodigy": ProdigyCounters(optimizer)} if t.optimizer == "prodigy" else {}
    return objects, params


def steps(objects, params, t, first, last):
    scaler = LossScaler(d.device, enabled=False)
    for step in range(first, last + 1):
        objects["optimizer"].set_lr(trainer.lr_factor(step, t))
        generators = [data.keyed_generator(0, step, rank)]
        loss = adapter.train_loss(objects["model"], batches[step - 1], generators).mean()
        loss.backward()
        trainer.clip_and_step(params, objects["optimizer"], scaler, t, objects["train"], step, loss.detach())


def full(objects):
    return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in objects["model"].named_parameters() if p.requires_grad}


report = {}
for name in sys.argv[4].split(","):
    for kind in ("lora", "sft"):
        t = TrainConfig(training_type=kind, optimizer=name, mixed_precision="no", gradient_checkpointing=False,
                        learning_rate=1.0 if name == "prodigy" else 1e-3, lr_warmup_steps=2, steps=4,
        # prodigy: its estimate d grows within these 4 steps only so (and the checkpoint must carry it)
        optimizer_args={"d_coef": 100.0} if name == "prodigy" else {})
        parallel = "fsdp"
        out = f"{sys.argv[3]}/{name}-{kind}"
        identity = {"training_type": kind, "precision": {}, "optimizer": name}
        objects, params = build(t, parallel)
        steps(objects, params, t, 1, 2)
        checkpoints = ckpt.Checkpointer(CheckpointConfig(checkpointing_limit=0), out, d, identity, {})
        checkpoints.save(2, objects, final=True)
        start = full(objects)
        steps(objects, params, t, 3, 4)
        uninterrupted = full(objects)
        del objects, params
        objects, params = build(t, parallel)  # the killed run, launched again
        resumed = ckpt.Checkpointer(CheckpointConfig(), out, d, identity, {}).resume(objects)
        loaded = full(objects)
        steps(objects, params, t, 3, 4)
        end = full(objects)
        groups = objects["optimizer"].param_groups
        report[f"{name}-{kind}"] = {
            "resumed": str(resumed), "step": objects["train"].step,
            "loaded_equal": all(torch.equal(loaded[n], start[n]) for n in start),
            "moved": any(not torch.equal(start[n], uninterrupted[n]) for n in start),
            "bitwise": all(torch.equal(end[n], uninterrupted[n]) for n in end),
            "optimizers": [type(o).__name__ for o in objects["optimizer"]],
            "group_lrs": sorted({float(g["initial_lr"]) for g in groups}),
            "state_keys": len(objects["optimizer"].state),
        "d_grew": name != "prodigy" or groups[0]["d"] > groups[0]["d0"],
        "quantized": sum(type(getattr(v, "_local_tensor", v)).__name__ == "OptimState8bit"
                         for st in objects["optimizer"].state.values() for v in st.values()),
        }
        # resharded: the checkpoint loaded whole into a DDP build
        ddp, ddp_params = build(t, "ddp")
        ckpt.Checkpointer(CheckpointConfig(resume=f"{out}/checkpoint-2"), out, d, identity, {}).resume(ddp)
        whole = full(ddp)
        report[f"{name}-{kind}"] |= {
            "reshard_weights": sorted(whole) == sorted(start) and all(torch.equal(whole[n], start[n]) for n in start),
            "reshard_state": len(ddp["optimizer"].state) == len(objects["optimizer"].state),
        }
        if name in WHOLE_WEIGHT_STEPS:  # the library's own step on DDP's whole weights, from step 1
            ddp, ddp_params = build(t, "ddp")
            steps(ddp, ddp_params, t, 1, 4)
            report[f"{name}-{kind}"]["ddp_difference"] = max(
                (full(ddp)[n] - uninterrupted[n]).abs().max().item() for n in uninterrupted
            )
        del ddp, ddp_params
        del objects, params
with open(f"{sys.argv[3]}/rank{rank}.json", "w") as f:
    json.dump(report, f)
command.shutdown()
"""


@pytest.mark.slow
def test_every_optimizer_resumes_bitwise_on_two_ranks(tiny_models, tmp_path):
    result = run_worker(
        WORKER,
        tmp_path,
        tiny_models("2b"),
        tmp_path,
        ",".join(OPTIMIZERS),
        timeout=600,
        TORCHDYNAMO_DISABLE="1",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(report) == sorted(f"{o}-{k}" for o in OPTIMIZERS for k in ("lora", "sft"))
        for case, r in report.items():
            assert r["resumed"].endswith("checkpoint-2") and r["step"] == 4, (case, r)
            assert r["loaded_equal"] and r["moved"] and r["bitwise"], (case, r)
            assert r["state_keys"] > 0 and r["d_grew"], (case, r)
            assert r["reshard_weights"] and r["reshard_state"], (case, r)  # FSDP2's checkpoint into DDP
            if case.startswith(tuple(model.WHOLE_WEIGHT_STEPS)):
                # the whole-weight steps under FSDP2 against torch's Adafactor and prodigyopt's
                # Prodigy on DDP's plain weights: the same 4 updates, but for the gradients' rounding
                assert r["optimizers"][0].startswith("WholeWeight") and r["ddp_difference"] < 1e-6, (case, r)
        # LoRA+: B at 4x; Muon: 2-D weights, and in sft the rest with AdamW
        assert report["adamw-lora"]["group_lrs"] == [1e-3, 4e-3]
        assert report["muon-lora"]["optimizers"] == ["Muon"]
        assert report["muon-sft"]["optimizers"] == ["Muon", "AdamW"]
        assert report["adamw8bit-sft"]["optimizers"] == ["AdamW8bit"]
        # both moments of A and B of 4 layers in 2 blocks
        assert report["adamw8bit-lora"]["quantized"] == 2 * 2 * 4 * 2


def tiny_net() -> torch.nn.Module:
    """Weights of every rank Muon sorts: 2-D linear weights, 1-D biases and norms, a 5-D conv."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 1), torch.nn.Flatten(), torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)
    )


def test_optimizer_args_are_checked_against_the_signature():
    check = lambda **t: model.check_optimizer(TrainConfig(**t), LoraConfig(), torch.device("cpu"))
    check(optimizer="prodigy", learning_rate=1.0, optimizer_args={"d_coef": 0.5, "safeguard_warmup": True})
    check(optimizer="muon", optimizer_args={"ns_steps": 3, "adjust_lr_fn": "original"})
    with pytest.raises(ConfigError, match=r"'beta1'.*allowed are beta2_decay, eps, d, foreach, maximize"):
        check(optimizer="adafactor", optimizer_args={"beta1": 0.9})
    # the train.* keys' own arguments, and the ones vidtrain fixes, are not set from there
    for optimizer, key in (
        ("adamw", "betas"),
        ("adamw", "fused"),
        ("muon", "lr"),
        ("prodigy", "fsdp_in_use"),
    ):
        with pytest.raises(ConfigError, match=f"'{key}', which {optimizer} .* does not take"):
            check(optimizer=optimizer, learning_rate=1.0, optimizer_args={key: 1})
    # a value the optimizer refuses, in its own words, before any compute
    with pytest.raises(ConfigError, match="prodigy refuses its arguments: Invalid d0 value: -1"):
        check(optimizer="prodigy", learning_rate=1.0, optimizer_args={"d0": -1})


def test_optimizer_refusals(monkeypatch):
    lora_plus = LoraConfig(plus_ratio=16.0)
    with pytest.raises(ConfigError, match='lora.plus_ratio with train.optimizer = "prodigy"'):
        model.check_optimizer(
            TrainConfig(optimizer="prodigy", learning_rate=1.0),
            lora_plus,
            torch.device("cpu"),
        )
    with pytest.raises(ConfigError, match='"adamw8bit" runs on CUDA and CPU devices .* not on mps'):
        model.check_optimizer(TrainConfig(optimizer="adamw8bit"), LoraConfig(), torch.device("mps"))
    # torchao is optional: without it adamw8bit is refused before any compute, naming the install
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchao" else found(name))
    with pytest.raises(
        ConfigError, match=r"\"adamw8bit\" needs torchao, which is not installed: pip install"
    ):
        model.check_optimizer(TrainConfig(optimizer="adamw8bit"), LoraConfig(), torch.device("cpu"))


def test_muon_takes_the_2d_weights_and_adamw_the_rest():
    net = tiny_net()
    t = TrainConfig(optimizer="muon", learning_rate=0.01, weight_decay=0.1)
    params, optimizers = model.build_optimizer(net, t)
    muon, adamw = optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [p.ndim for g in muon.param_groups for p in g["params"]] == [2]
    assert sorted(p.ndim for g in adamw.param_groups for p in g["params"]) == [1, 1, 1, 1, 5]
    assert muon.defaults["adjust_lr_fn"] == "match_rms_adamw" and adamw.defaults["fused"]
    assert adamw.defaults["betas"] == (t.adam_beta1, t.adam_beta2) and adamw.defaults["weight_decay"] == 0.1
    assert len(params) == 6


def test_lora_plus_puts_b_at_its_multiple_of_the_learning_rate():
    import lora

    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    lora.inject_lora(net, ["0"], 2, 2.0, 0.0, 0)
    net.requires_grad_(False)
    for name, p in net.named_parameters():
        p.requires_grad_("lora_" in name)
    for optimizer in OPTIMIZERS[:3] + OPTIMIZERS[4:]:  # prodigy refuses it (test above)
        t = TrainConfig(optimizer=optimizer, learning_rate=1e-3)
        _, optimizers = model.build_optimizer(net, t, plus_ratio=16.0)
        lrs = {id(p): float(g["lr"]) for g in optimizers.param_groups for p in g["params"]}
        # torchao keeps the rate a float32 tensor
        assert lrs == pytest.approx({id(net[0].lora_A.weight): 1e-3, id(net[0].lora_B.weight): 16e-3}), (
            optimizer
        )
        optimizers.set_lr(0.5)  # the schedule scales each group's own peak
        assert sorted(float(g["lr"]) for g in optimizers.param_groups) == pytest.approx([5e-4, 8e-3])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_with_a_non_finite_gradient_changes_nothing(optimizer):
    """Fused AdamW skips it on the device (found_inf); the others on the host's reading of the flag."""
    net = tiny_net()
    params, optimizers = model.build_optimizer(net, TrainConfig(optimizer=optimizer, learning_rate=0.1))
    for p in params:
        p.grad = torch.ones_like(p)
    optimizers.step(torch.tensor(False))
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    optimizers.step(torch.tensor(True))
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def test_optimizer_args_round_trip_through_the_resolved_config():
    """config.toml (to_toml) writes the table inline; an override reads one."""
    import tomllib

    from config import parse_overrides, toml_value

    args = {"d_coef": 0.5, "betas": [0.9, 0.99], "safeguard_warmup": True}
    assert tomllib.loads(f"v = {toml_value(args)}")["v"] == args
    assert parse_overrides(["--train.optimizer_args", "{ d_coef = 0.5 }"]) == {
        "train.optimizer_args": {"d_coef": 0.5}
    }
