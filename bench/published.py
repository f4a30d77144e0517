"""The published transformer and text encoder configs, and a model folder holding only configs, for the
benchmarks that build full-size models without their weights (bench_memory.py --arch, bench_gpu.py)."""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel, UniPCMultistepScheduler, WanTransformer3DModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import ConfigError  # noqa: E402
from model import load_adapter  # noqa: E402
from tools.make_tiny_model import make_scheduler  # noqa: E402

TRANSFORMERS = {"cogvideox": CogVideoXTransformer3DModel, "wan": WanTransformer3DModel}
# Published transformer configs (cogvideox.md: 5B's values besides these are the class defaults; wan.md).
PUBLISHED = {
    "cogvideox-2b": ("cogvideox", {"num_attention_heads": 30, "num_layers": 30}),  # the class defaults, spelled out
    "cogvideox-5b": ("cogvideox", {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True}),
    "wan2.1-t2v-14b": ("wan", WAN_14B := {"num_attention_heads": 40, "attention_head_dim": 128, "num_layers": 40,
                                          "ffn_dim": 13824, "in_channels": 16, "out_channels": 16, "text_dim": 4096,
                                          "freq_dim": 256, "eps": 1e-6, "patch_size": [1, 2, 2], "cross_attn_norm": True,
                                          "rope_max_seq_len": 1024}),
    "wan2.1-t2v-1.3b": ("wan", {**WAN_14B, "num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960}),
    "wan2.2-t2v-a14b": ("wan", WAN_14B),  # two experts of 2.1-14B's config, transformer/ and transformer_2/
}
PIPELINE_EXTRAS = {"wan2.2-t2v-a14b": {"boundary_ratio": 0.875}}
# The text encoders' published configs (T5 v1.1 XXL's and UMT5-XXL's encoders, docs/models/), for --arch.
T5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "feed_forward_proj": "gated-gelu"}
TEXT_ENCODERS = {"cogvideox": {**T5_XXL, "vocab_size": 32128}, "wan": {**T5_XXL, "vocab_size": 256384}}


def make_adapter(cfg, arch: str | None, root: Path, device: torch.device):
    """(family, adapter): model.path's, or the adapter of a folder holding only the published configs."""
    if arch is None:
        if not Path(cfg.model.path, "model_index.json").is_file():
            raise ConfigError(f"model.path = {cfg.model.path} is not here: pass --arch ({', '.join(PUBLISHED)})")
        return cfg.model.family, load_adapter(cfg.model, device)
    family, published = PUBLISHED[arch]
    transformer, vae, pipeline = {"cogvideox": ("CogVideoXTransformer3DModel", "AutoencoderKLCogVideoX", "CogVideoXPipeline"),
                                  "wan": ("WanTransformer3DModel", "AutoencoderKLWan", "WanPipeline")}[family]
    extras = PIPELINE_EXTRAS.get(arch, {})
    experts = ("transformer", "transformer_2") if "boundary_ratio" in extras else ("transformer",)
    configs = {**{folder: {"_class_name": transformer, **published} for folder in experts},
               "vae": {"_class_name": vae}, "text_encoder": TEXT_ENCODERS[family], "tokenizer": {}}
    for name, config in configs.items():  # VAE, scheduler: class defaults (memory does not depend on them)
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **extras}))
    scheduler = make_scheduler(1.0) if family == "cogvideox" else UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    scheduler.save_pretrained(root / "scheduler")
    model_cfg = dataclasses.replace(cfg.model, path=str(root), family=family)
    return family, load_adapter(model_cfg, device)


def meta_transformer(cls, config: dict, dtype: torch.dtype):
    """The transformer as from_pretrained(dtype=...) loads it, on the meta device: parameters in dtype but
    the class's keep-in-fp32 modules; buffers in the dtype they are made in."""
    with torch.device("meta"):
        transformer = cls.from_config(config)
    for name, p in transformer.named_parameters():
        p.data = p.data.to(torch.float32 if set(name.split(".")) & set(cls._keep_in_fp32_modules or []) else dtype)
    return transformer
