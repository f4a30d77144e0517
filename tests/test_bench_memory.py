"""bench/bench_memory.py: the fake-tensor estimate against a measured step, and the per-rank arithmetic."""

import json
import shutil
import sys

from conftest import REPO, write_toml

sys.path.insert(0, str(REPO / "bench"))
import bench_memory  # noqa: E402
from config import load_config  # noqa: E402


def test_estimate_matches_a_measured_step(tiny_models, tmp_path):
    """sft with EMA and checkpointing on a 512-wide CogVideoX: the estimate's state, step and peak are
    within 15% of what a fresh process measures (resident growth, VmHWM)."""
    model = shutil.copytree(tiny_models("5b"), tmp_path / "model")
    config = json.loads((model / "transformer" / "config.json").read_text())
    config.update(num_attention_heads=8, attention_head_dim=64, text_embed_dim=512, time_embed_dim=256,
                  max_text_seq_length=64)
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    cfg_file = write_toml(tmp_path / "sft.toml", {
        "run.output_dir": str(tmp_path / "run"), "model.path": str(model), "data.data_root": str(tmp_path),
        "data.train_resolution": [17, 96, 160], "train.training_type": "sft", "train.ema_decay": 0.99})
    cfg = load_config(str(cfg_file))
    family, adapter = bench_memory.make_adapter(cfg, None, tmp_path, bench_memory.torch.device("cpu"))
    ratios = bench_memory.check(cfg, family, adapter, ["--cfg", str(cfg_file)])
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_sharding_and_sequence_parallel(tmp_path):
    """One full-width Wan 2.1 14B block: FSDP divides the state by the shards and adds what is in flight;
    sp 2 halves the video tokens and about halves the activations."""
    cfg_file = write_toml(tmp_path / "wan.toml", {
        "run.output_dir": str(tmp_path / "run"), "model.path": str(tmp_path), "data.data_root": str(tmp_path),
        "data.train_resolution": [81, 720, 1280], "lora.rank": 16})
    cfg = load_config(str(cfg_file))
    family, adapter = bench_memory.make_adapter(cfg, "wan2.1-t2v-14b", tmp_path, bench_memory.torch.device("cpu"))
    adapter.transformer_config["num_layers"] = 1
    ddp, ddp_sp2 = (bench_memory.estimate(cfg, family, adapter, sp, world=8) for sp in (1, 2))
    cfg.parallel.strategy = "fsdp"
    fsdp = bench_memory.estimate(cfg, family, adapter, 1, world=8)
    assert (ddp["video_tokens"], ddp["rank_tokens"], ddp_sp2["rank_tokens"]) == (75600, 75600, 37800)
    assert ddp["frozen"] == ddp_sp2["frozen"] and ddp["trainable"] == ddp_sp2["trainable"]
    assert 0.45 < ddp_sp2["activations"] / ddp["activations"] < 0.55
    assert fsdp["frozen"] == ddp["frozen"] / 8 and fsdp["trainable"] == ddp["trainable"] / 8
    assert fsdp["in_flight"] > 3 * ddp["frozen"] / 8 and fsdp["activations"] <= ddp["activations"]
