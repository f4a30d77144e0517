"""torchrun on gloo: DDP and FSDP2 against one process, rendezvous, sharding, failures.

DDP and FSDP2 compute the same updates as one process, two nodes rendezvous, FSDP shards the state,
a failing rank ends the job with one message, the non-finite guard."""

import os
import re
import signal
import subprocess

import pytest
import torch
import torch.distributed as dist
from conftest import (
    K5_TARGETS,
    REPO,
    finish,
    free_port,
    hv_batch,
    k5_batch,
    prepare_run,
    read_metrics,
    run_cmd,
    run_ok,
    run_worker,
    start_paused,
    train_losses,
    write_toml,
)
from diffusers import CogVideoXTransformer3DModel
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import data
import ranks
from config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig, load_config
from data import Sampler, micro_slice
from model import build_model
from model_adapter import load_adapter

RTOL, ATOL = 1e-5, 1e-6
MAX_GRAD_NORM = 1e-3  # below every step's gradient norm: clipping changes each update
# G = 4 in every variant: 1 x 4, 2 ranks x 2, accumulation 2 x 2, 4 ranks x 1 as 2 replicas of 2
# shards (with FSDP2's CPU offload policy: on CPUs it runs the same code, with nothing to move).
VARIANTS = {
    "one_process": ({"train.batch_size": 4}, 1),
    "accumulation": ({"train.batch_size": 2, "train.gradient_accumulation_steps": 2}, 1),
    "ddp": ({"train.batch_size": 2, "parallel.strategy": "ddp"}, 2),
    "fsdp": ({"train.batch_size": 2, "parallel.strategy": "fsdp"}, 2),
    "hsdp": (
        {
            "train.batch_size": 1,
            "parallel.strategy": "fsdp",
            "parallel.dp_replicate": 2,
            "parallel.cpu_offload": True,
        },
        4,
    ),
}


def lora_weights(output_dir):
    return load_file(output_dir / "lora" / "pytorch_lora_weights.safetensors")


def logged(output_dir, tag: str) -> dict[int, float]:
    return {m["step"]: m[tag] for m in read_metrics(output_dir) if tag in m}


def assert_close_runs(a, b, rtol=RTOL, atol=ATOL):
    for tag in ("train/loss", "train/grad_norm"):
        values_a, values_b = logged(a, tag), logged(b, tag)
        assert values_a.keys() == values_b.keys()
        torch.testing.assert_close(
            torch.tensor(list(values_a.values())),
            torch.tensor(list(values_b.values())),
            rtol=rtol,
            atol=atol,
            msg=tag,
        )
    wa, wb = lora_weights(a), lora_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=rtol, atol=atol, msg=key)


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory, base_settings):
    """Each variant trained once (fp32, clipping on every step), shared by the tests below."""
    root = tmp_path_factory.mktemp("variants")
    outputs = {}
    for name, (settings, nproc) in VARIANTS.items():
        outputs[name] = root / name
        cfg = write_toml(
            root / f"{name}.toml",
            {
                **base_settings,
                "run.output_dir": str(root / name),
                "train.steps": 5,
                "checkpoint.checkpointing_steps": 5,
                "train.max_grad_norm": MAX_GRAD_NORM,
                **settings,
            },
        )
        run_ok(["--cfg", str(cfg)], nproc=nproc)
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["accumulation", "ddp", "fsdp", "hsdp"])
def test_same_update_as_one_process(variant_runs, name):
    """Losses, gradient norms (before clipping) and final weights agree; every step was clipped."""
    assert all(
        norm > MAX_GRAD_NORM for norm in logged(variant_runs["one_process"], "train/grad_norm").values()
    )
    assert_close_runs(variant_runs["one_process"], variant_runs[name])


@pytest.mark.slow
def test_logged_loss_is_the_global_mean(variant_runs, base_settings, tmp_path):
    """The logged loss is the mean over ranks, recomputed here for step 1.

    Two ranks log one value per step: the mean over ranks of their losses, here recomputed in this
    process from the cache, the sampler and the keyed generators for step 1 (before any update)."""
    assert [m["step"] for m in read_metrics(variant_runs["ddp"]) if "train/loss" in m] == [1, 2, 3, 4, 5]
    cfg = load_config(
        str(write_toml(tmp_path / "c.toml", {**base_settings, "run.output_dir": str(tmp_path)}))
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = ranks.Dist(0, 1, 0, torch.device("cpu"))
        adapter, cache, clips, _ = prepare_run(cfg, d)
        model = build_model(adapter, cfg.train, cfg.lora, cfg.parallel, cfg.run.seed, d)
        batch_ids = Sampler([c.bucket for c in clips], 4, cfg.run.seed).next_batch()
        with torch.no_grad():
            per_rank = [
                adapter.train_loss(
                    model,
                    cache.load_batch([clips[batch_ids[p]] for p in positions]),
                    [data.keyed_generator(cfg.run.seed, 1, p) for p in positions],
                ).mean()
                for positions in (micro_slice(0, r, 2, 2) for r in range(2))
            ]
    finally:
        dist.destroy_process_group()
    # the ranks' own losses differ: their mean is a real check
    assert abs(per_rank[0] - per_rank[1]) > 1e-3
    assert logged(variant_runs["ddp"], "train/loss")[1] == pytest.approx(float(sum(per_rank) / 2), rel=RTOL)
    assert all(
        m["train/samples_per_s"] > 0 and m["train/peak_mem_gb"] > 0
        for m in read_metrics(variant_runs["ddp"])
        if "train/loss" in m
    )


@pytest.mark.slow
def test_bf16_fsdp_stays_near_fp32(variant_runs, write_config, tmp_path):
    cfg = write_config(
        "bf16",
        **{
            "train.batch_size": 2,
            "parallel.strategy": "fsdp",
            "model.dtype": "bf16",
            "train.mixed_precision": "bf16",
            "train.gradient_checkpointing": True,
            "train.steps": 5,
            "checkpoint.checkpointing_steps": 5,
            "train.max_grad_norm": MAX_GRAD_NORM,
        },
    )
    run_ok(["--cfg", str(cfg)], nproc=2)
    # bf16 keeps 8 bits of mantissa: per-step losses agree to about 1%.
    losses, reference = train_losses(tmp_path / "bf16"), train_losses(variant_runs["fsdp"])
    torch.testing.assert_close(
        torch.tensor(list(losses.values())), torch.tensor(list(reference.values())), rtol=1e-2, atol=1e-3
    )


@pytest.mark.slow
def test_two_nodes_through_launch_sh(variant_runs, write_config, tmp_path):
    """2 nodes x 1 process through a c10d rendezvous on localhost, HSDP (replicate across nodes)."""
    cfg = write_config(
        "nodes",
        **{
            "train.batch_size": 2,
            "parallel.strategy": "fsdp",
            "parallel.dp_replicate": 2,
            "train.steps": 5,
            "checkpoint.checkpointing_steps": 5,
            "train.max_grad_norm": MAX_GRAD_NORM,
        },
    )
    port = free_port()
    env = {
        **os.environ,
        "NNODES": "2",
        "NPROC": "1",
        "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "OMP_NUM_THREADS": "1",
    }
    nodes = [
        subprocess.Popen(
            ["bash", str(REPO / "launch.sh"), str(cfg)],
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-3000:] + outputs[1][-3000:]
    assert (tmp_path / "nodes" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert_close_runs(variant_runs["fsdp"], tmp_path / "nodes")


@pytest.mark.slow
def test_fsdp_shards_sft_state(write_config, tmp_path):
    """FSDP holds about half of DDP's sft state per rank, and each rank reads only its rows.

    Full fine-tuning on 2 ranks: FSDP holds about half of DDP's parameter + optimizer bytes per
    rank, and rank 0 read only its half of the weight file (its shard, made fp32 from the file's
    rows)."""
    state_mb, read = {}, {}
    for strategy in ("ddp", "fsdp"):
        cfg = write_config(
            strategy,
            **{
                "train.training_type": "sft",
                "parallel.strategy": strategy,
                "train.steps": 2,
                "checkpoint.checkpointing_steps": 2,
                "validation.do_validation": False,
            },
        )
        result = run_ok(["--cfg", str(cfg)], nproc=2)
        state_mb[strategy] = read_metrics(tmp_path / strategy)[0]["train/state_mb"]
        read[strategy] = float(re.search(r"loaded transformer/: read ([\d.]+)% of", result.stderr).group(1))
        # The export holds exactly the final checkpoint's weights, as DCP's own converter reads
        # them.
        dcp_to_torch_save(tmp_path / strategy / "checkpoint-2", tmp_path / f"{strategy}.pt")
        trained = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)["model"]
        exported = CogVideoXTransformer3DModel.from_pretrained(
            tmp_path / strategy / "transformer"
        ).state_dict()
        assert exported.keys() == trained.keys() and all(
            torch.equal(exported[k], trained[k]) for k in trained
        )
    assert 0.45 < state_mb["fsdp"] / state_mb["ddp"] < 0.55, state_mb
    assert read["ddp"] == 100.0 and 45 < read["fsdp"] < 55, read
    assert train_losses(tmp_path / "ddp") == pytest.approx(train_losses(tmp_path / "fsdp"), rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, message",
    [
        # one rank raises: it reports, the other is quiet
        ("step_fail:3:1", "OSError: injected fault step_fail at 3"),
        # One rank hangs: whichever rank times out first reports it, the other is quiet. (Rank 0's
        # own timeout once read as a lost peer, and in 4 runs of 16 neither rank reported it.)
        ("step_deadlock:3:1", "TimeoutError: rank"),
    ],
)
def test_a_failure_ends_the_job_with_one_message(write_config, tmp_path, fault, message):
    cfg = write_config("fail", **{"train.batch_size": 2, "parallel.timeout_s": 10})
    # A hang would outlive the subprocess timeout and fail the test.
    result = run_cmd(["--cfg", str(cfg)], nproc=2, env={"VIDTRAIN_FAULT": fault}, timeout=150)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(message) == 1, output[-4000:]


@pytest.mark.slow
def test_ctrl_c_stops_with_one_message(write_config, tmp_path):
    """Ctrl-C stops the run with one line, and launch.sh exits 130.

    Ctrl-C reaches launch.sh and torchrun (a terminal signals its foreground process group), and
    torchrun passes it on: the trainer prints one line and no traceback of its own, and launch.sh
    exits 130 as the trainer did (torchrun itself exits 1 after a signal)."""
    process, _, output = start_paused([str(write_config("interrupted"))], "step_pause:2", script="launch.sh")
    os.killpg(process.pid, signal.SIGINT)
    code, output = finish(process, output)
    assert code == 130 and output.count("interrupted: stopped without a checkpoint") == 1, output[-4000:]
    assert "KeyboardInterrupt" not in output


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop_the_run(write_config, tmp_path):
    run_ok(["--cfg", str(write_config("skip"))], env={"VIDTRAIN_FAULT": "nan_loss:2"})
    metrics = {m["step"]: m for m in read_metrics(tmp_path / "skip") if "train/loss" in m}
    assert metrics[2]["train/grad_norm"] != metrics[2]["train/grad_norm"]  # NaN, the update skipped
    assert [m["train/skipped_steps"] for m in metrics.values()] == [0, 1, 0, 0, 0, 0]
    assert all(v == v for s, m in metrics.items() if s != 2 for v in m.values())
    stop = run_cmd(
        ["--cfg", str(write_config("stop", **{"train.max_nonfinite_steps": 1}))],
        env={"VIDTRAIN_FAULT": "nan_loss:2"},
    )
    assert stop.returncode == 1 and "step 2: 1 steps in a row with a non-finite gradient norm" in stop.stderr
    # The count lives on the device and is read on log steps, saves and validations only: here step
    # 4.
    late = run_cmd(
        [
            "--cfg",
            str(
                write_config(
                    "late",
                    **{
                        "train.max_nonfinite_steps": 1,
                        "train.log_every": 4,
                        "checkpoint.checkpointing_steps": 6,
                        "validation.validation_steps": 6,
                    },
                )
            ),
        ],
        env={"VIDTRAIN_FAULT": "nan_loss:2"},
    )
    assert (
        late.returncode == 1
        and "step 2: 1 steps in a row with a non-finite gradient norm "
        "(train.max_nonfinite_steps; seen at step 4)"
        in late.stderr
    )
    assert not list((tmp_path / "late").glob("checkpoint-*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, settings",
    [(1, {"train.batch_size": 4}), (2, {"train.batch_size": 2, "parallel.strategy": "fsdp"})],
)
def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale(
    write_config, tmp_path, nproc, settings
):
    """An fp16 overflow skips the step on every rank and halves the loss scale.

    fp16 autocast on CPU: step 3's gradients overflow (on the last rank only, with two), so every
    rank skips the update (its weights and Adam's state are those of step 2: FSDP's shards too) and
    halves the loss scale; the loss was finite, so train.max_nonfinite_steps = 1 does not stop the
    run. A NaN loss does. The scale is a tensor in the checkpoint."""
    cfg = write_config(
        "fp16",
        **{
            "train.mixed_precision": "fp16",
            "train.max_nonfinite_steps": 1,
            "checkpoint.checkpointing_steps": 1,
            "checkpoint.checkpointing_limit": 0,
            "validation.do_validation": False,
            **settings,
        },
    )
    run_ok(["--cfg", str(cfg)], nproc=nproc, env={"VIDTRAIN_FAULT": f"overflow:3:{nproc - 1}"})
    metrics = {m["step"]: m for m in read_metrics(tmp_path / "fp16") if "train/loss" in m}
    assert [m["train/loss_scale"] for m in metrics.values()] == [2.0**16] * 2 + [2.0**15] * 4
    assert [m["train/skipped_steps"] for m in metrics.values()] == [0, 0, 1, 0, 0, 0]
    assert all(m["train/loss"] == m["train/loss"] for m in metrics.values())
    states = {}
    for step in (2, 3, 4):
        dcp_to_torch_save(tmp_path / "fp16" / f"checkpoint-{step}", tmp_path / f"{step}.pt")
        states[step] = torch.load(tmp_path / f"{step}.pt", weights_only=True)
    for part in ("model", "optimizer"):
        assert states[2][part].keys() == states[3][part].keys()
        assert all(torch.equal(states[2][part][k], states[3][part][k]) for k in states[2][part]), part
    assert not all(torch.equal(states[3]["model"][k], states[4]["model"][k]) for k in states[3]["model"])
    assert [states[s]["scaler"]["scale"].item() for s in (2, 3, 4)] == [2.0**16, 2.0**15, 2.0**15]
    if nproc == 1:
        nan = run_cmd(
            [
                "--cfg",
                str(
                    write_config(
                        "fp16_nan",
                        **{"train.mixed_precision": "fp16", "train.max_nonfinite_steps": 1, **settings},
                    )
                ),
            ],
            env={"VIDTRAIN_FAULT": "nan_loss:3"},
        )
        assert (
            nan.returncode == 1 and "step 3: 1 steps in a row with a non-finite gradient norm" in nan.stderr
        )


def test_ddp_broadcasts_no_buffer_at_each_forward(tiny_model, monkeypatch):
    """The trainer's DDP broadcasts no buffer before each forward.

    The trainer's DDP (parallel.wrap) sends no buffer from rank 0 before each forward, as torch's
    default would: no buffer changes in training, and CogVideoX-2B's float64 positions (the tiny 2b
    model has them) are 260 MiB at 49x480x720. DDP's broadcasts counted on 2 ranks of a fake process
    group (collectives that do nothing, so no backward: its reduction wants a result) in this
    process, over two forwards with autograd on; the same model under torch's default DDP is the
    counter's control."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    broadcasts, broadcast = [], dist._broadcast_coalesced
    monkeypatch.setattr(
        dist,
        "_broadcast_coalesced",
        lambda group, tensors, *args: (
            broadcasts.append([(tuple(t.shape), t.dtype) for t in tensors])
            or broadcast(group, tensors, *args)
        ),
    )
    cpu = torch.device("cpu")
    adapter = load_adapter(ModelConfig(path=str(tiny_model), dtype="fp32"), cpu)
    inputs = {
        "hidden_states": torch.randn(1, 3, 4, 8, 8),
        "encoder_hidden_states": torch.randn(1, 16, 32),
        "timestep": torch.tensor([10]),
    }
    per_forward = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ours = build_model(
            adapter, TrainConfig(), LoraConfig(), ParallelConfig(strategy="ddp"), 0, ranks.Dist(0, 2, 0, cpu)
        )
        for name, model in (("ours", ours), ("default", DistributedDataParallel(ours.module))):
            broadcasts.clear()
            for _ in range(2):
                model(**inputs)
            per_forward[name] = list(broadcasts)
    finally:
        dist.destroy_process_group()
    assert isinstance(ours, DistributedDataParallel)
    assert per_forward == {"ours": [], "default": [[((1, 64, 32), torch.float64)]] * 2}


def test_launch_sh_prints_our_error_last(write_config, tmp_path):
    """launch.sh prints our error line last; torchrun's own report goes to torchrun.log.

    A multi-rank failure through launch.sh: our one error line comes last, torchrun's own traceback
    and ChildFailedError block go to run.output_dir/torchrun.log instead of the terminal."""
    cfg = write_config(
        "launch_fails",
        **{"train.steps": 2, "checkpoint.checkpointing_steps": 2, "validation.do_validation": False},
    )
    result = run_cmd(
        [str(cfg), "--train.batch_size", "1"],
        nproc=2,
        env={"VIDTRAIN_FAULT": "save_fail:2:1"},
        script="launch.sh",
    )
    out = tmp_path / "launch_fails"
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert lines[-1].startswith(
        f"error: writing {out / 'checkpoint-2.tmp'} failed on rank 1: OSError: [Errno 28]"
    )
    assert lines[-2] == f"torchrun's own report: {out / 'torchrun.log'}"
    assert "ChildFailedError" not in result.stderr + result.stdout and "Traceback" not in result.stderr
    kept = (out / "torchrun.log").read_text()
    assert "ChildFailedError" in kept and "failed on rank 1: OSError" in kept


FAMILY_WORKER = r"""
import sys, torch, torch.distributed as dist
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import ranks
from config import ModelConfig
from test_distributed import family_gradients

dist.init_process_group("gloo")
rank = dist.get_rank()
family, variant, batch, out = sys.argv[3], sys.argv[4], torch.load(sys.argv[5]), sys.argv[6]
model_cfg = ModelConfig(path=sys.argv[2], family=family, type=variant, dtype="fp32")
grads = family_gradients(model_cfg, batch, ranks.Dist(rank, 2, rank, torch.device("cpu")))
if rank == 0:
    torch.save(grads, out)
dist.destroy_process_group()
"""

# sft under DDP and LoRA under HSDP (2 replicas of 1 shard): the two strategies the newest families'
# lifecycles (FSDP2) do not run. Their LoRA targets: Kandinsky's layers are its own names.
FAMILY_STRATEGIES = {
    "ddp": ("sft", {"strategy": "ddp"}),
    "hsdp": ("lora", {"strategy": "fsdp", "dp_replicate": 2}),
}

FAMILY_TARGETS = {"kandinsky5": {"target_modules": K5_TARGETS}}


def family_gradients(model_cfg, batch: dict, d) -> dict:
    """Each strategy's gradients of the batch's loss, whole, by weight name; `d` of one rank: the
    one-process reference, built with no strategy."""
    adapter = load_adapter(model_cfg, d.device)
    grads = {}
    for name, (kind, strategy) in FAMILY_STRATEGIES.items():
        train = TrainConfig(training_type=kind, mixed_precision="no", gradient_checkpointing=False)
        model = build_model(
            adapter,
            train,
            LoraConfig(rank=4, **FAMILY_TARGETS.get(model_cfg.family, {})),
            ParallelConfig(**strategy) if d.world > 1 else ParallelConfig(),
            0,
            d,
        )
        n = batch["latent_mean"].shape[0]
        loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(i + 1) for i in range(n)])
        loss.sum().backward()
        grads[name] = {
            k.removeprefix("module."): getattr(p.grad, "full_tensor", lambda g=p.grad: g)().detach()
            for k, p in model.named_parameters()
            if p.grad is not None
        }
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("family", ["kandinsky5", "hunyuanvideo15"])
def test_the_newest_families_reduce_as_one_process_under_ddp_and_hsdp(family, family_models, tmp_path):
    """Kandinsky 5 and HunyuanVideo 1.5 (their own lifecycles run FSDP2) under DDP (sft) and HSDP
    (LoRA) on 2 ranks, each with the same batch: every weight's gradient equals one process's on
    that batch (the ranks' mean of equal gradients; a sum, or a weight left out, would differ)."""
    variant, batch = {"kandinsky5": ("i2v", k5_batch), "hunyuanvideo15": ("i2v", hv_batch)}[family]
    path = family_models(family)(variant)
    torch.save(batch(), tmp_path / "batch.pt")
    result = run_worker(
        FAMILY_WORKER, tmp_path, path, family, variant, tmp_path / "batch.pt", tmp_path / "grads.pt"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reduced = torch.load(tmp_path / "grads.pt")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model_cfg = ModelConfig(path=str(path), family=family, type=variant, dtype="fp32")
        alone = family_gradients(model_cfg, batch(), ranks.Dist(0, 1, 0, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    for name in FAMILY_STRATEGIES:
        assert reduced[name].keys() == alone[name].keys() and alone[name], name
        for k in alone[name]:
            torch.testing.assert_close(
                reduced[name][k], alone[name][k], rtol=1e-5, atol=1e-7, msg=f"{name} {k}"
            )
    # sft trains every weight, LoRA its matrices only
    assert len(alone["ddp"]) > len(alone["hsdp"]) and all("lora_" in k for k in alone["hsdp"])
