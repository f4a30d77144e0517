"""Full-size CogVideoX and Wan 14B on one GPU: step time, MFU, peak memory, sampling, one-card cost.

Seconds per training step, model FLOP utilisation (MFU) and peak memory, our sampling step against
diffusers' pipeline's, and what the one-card settings cost.

    python bench/bench_gpu.py [--steps 4] [--sampling-steps 4] [--peak-tflops 989] [--only NAME ...]
                              [--smoke]
                              [--folder DIR]

Nothing is downloaded: each transformer is built from its published config (its family's Adapter.PUBLISHED)
with random weights, through model.build_model (LoRA rank 128 and alpha 64 on q, k, v, out as
configs/lora.toml, activation checkpointing, train.compile), then fused AdamW (bench_memory.build).
A training step does the model work of trainer.py's on a batch of 1 of random 49x480x720 latents
(13x60x90) and 226 text embeddings: the adapter's train_loss under bf16 autocast, backward, clip,
AdamW step, zero_grad (no metrics, no non-finite guard); the median of --steps, timed after 2
warm-up steps (which include the compile). Each configuration runs in a fresh process:

    2b-lora     CogVideoX-2B LoRA, checkpointing
    5b-lora     CogVideoX-5B LoRA, checkpointing
    5b-compile  5B LoRA, checkpointing, train.compile
    5b-no-ckpt  5B LoRA without checkpointing (running out of memory is reported as a result)
    5b-cudnn    5B LoRA, checkpointing, train.attention_backend = "cudnn" (5b-lora runs SDPA's
    5b-efficient  own choice, FlashAttention-2 on H100/H200; these print their time as a ratio
                  to it)
    sampling    5B, one guided sampling step (CFG batch 2, DPM): validate.sample_latents with fused
                QKV against CogVideoXPipeline(output_type="latent"), same weights, embeddings and
                seed
    14b-resident  Wan 2.1 T2V 14B LoRA r32 (configs/wan-t2v-14b.toml) at 81x480x832, one process,
                  every block resident (an 80 GB card)
    14b-one-gpu   the same with parallel.cpu_offload (offload_blocks = 0: every block streamed from
                  pinned host memory), model.storage_dtype = "fp8" and train.activation_offload; its
                  time is printed as a ratio to 14b-resident's: what the one-card settings cost in
                  speed

The 14b configurations build the model as trainer.py does (the adapter's loader reading a folder,
model.build_model, AdamW): the first writes Wan 2.1 14B's transformer with random bf16 weights (28
GB, drawn on the GPU) beside the tiny Wan's VAE and text encoder in --folder, reused after. Their
peak is printed beside bench_memory's estimate of the same setting's training step
(bench/one_gpu.py), and the pinned host memory torch's host allocator holds
(torch.cuda.host_memory_stats, under the allocator settings ranks.init sets) beside --fit's host
figure for the pinned weights and offloaded block inputs.

Model FLOPs of a step (what the step must compute; checkpointing's recompute is not counted), per
sample, for S tokens (226 text + the video's patches), L layers, width D = heads x head_dim, N the
weights of the block linears every token passes (attention's q, k, v, out and the feed-forward; not
the norms' projections of the timestep embedding, which see one token per sample):
    linear layers  forward 2NS; backward 2NS for the input gradients, plus 2NS for weight gradients
                   of trained weights only: LoRA 4NS + 6 N_lora S in all (full training: 6NS)
    attention      forward 4 L S^2 D (QK^T and PV), backward twice that: 12 L S^2 D in all
A guided sampling step is two forwards: 2 (2NS + 4 L S^2 D). MFU = model FLOPs / (seconds x peak);
peak = 989 TFLOPS, H100/H200 SXM dense bf16 (--peak-tflops for another chip). Peak memory is
torch.cuda.max_memory_allocated over the timed steps, weights and optimizer state included.

--smoke runs the same code on the CPU with 2-layer, 2-head versions of the models at 9x64x64 for one
step: it checks that the code runs; its figures mean nothing. 14b-one-gpu sets
parallel.offload_blocks, model.storage_dtype and train.activation_offload."""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import one_gpu  # noqa: E402
from bench_memory import build, cached_batch, estimate, materialize, shapes  # noqa: E402
from common import REPO, write_random_transformer  # noqa: E402
from published import make_adapter, meta_transformer, transformer_config  # noqa: E402

import command  # noqa: E402
import memory  # noqa: E402
import parallel  # noqa: E402
import ranks  # noqa: E402
import validate  # noqa: E402
from config import Config, ValidationConfig, load_config  # noqa: E402
from model import build_model, build_optimizer  # noqa: E402
from model_adapter import load_adapter  # noqa: E402
from tools.make_tiny_model import make_tiny_wan  # noqa: E402

CONFIGS = {  # name: (arch, train settings)
    "2b-lora": ("cogvideox-2b", {"gradient_checkpointing": True}),
    "5b-lora": ("cogvideox-5b", {"gradient_checkpointing": True}),
    "5b-compile": ("cogvideox-5b", {"gradient_checkpointing": True, "compile": True}),
    "5b-no-ckpt": ("cogvideox-5b", {"gradient_checkpointing": False}),
    "5b-cudnn": ("cogvideox-5b", {"gradient_checkpointing": True, "attention_backend": "cudnn"}),
    "5b-efficient": ("cogvideox-5b", {"gradient_checkpointing": True, "attention_backend": "efficient"}),
    "sampling": ("cogvideox-5b", {}),
    "14b-resident": ("wan2.1-t2v-14b", {}),
    "14b-one-gpu": ("wan2.1-t2v-14b", {}),
}
# Wan 2.1 14B LoRA (configs/wan-t2v-14b.toml) on one process, as the trainer builds it from a
# folder: every block resident, and every block streamed from pinned host memory with its linear
# weights stored in fp8 and the checkpointed block inputs in host memory.
ONE_GPU = {
    "14b-resident": {"parallel.strategy": "ddp"},
    "14b-one-gpu": {
        "parallel.strategy": "fsdp",
        "parallel.cpu_offload": True,
        "parallel.offload_blocks": 0,
        "model.storage_dtype": "fp8",
        "train.activation_offload": True,
    },
}
SMOKE = {"num_layers": 2, "num_attention_heads": 2}
WARMUP = 2


def setup(name: str, smoke: bool, root: Path):
    """The config and adapter of one configuration (its transformer config shrunk for --smoke)."""
    arch, train = CONFIGS[name]
    cfg = Config()
    cfg.data.train_resolution = [9, 64, 64] if smoke else [49, 480, 720]
    for key, value in train.items():
        setattr(cfg.train, key, value)
    cfg.model.dtype = "bf16"
    device = torch.device("cpu" if smoke else "cuda")
    family, adapter = make_adapter(cfg, arch, root, device)
    if smoke:
        adapter.transformer_config.update(SMOKE)
    return cfg, family, adapter, device


def sizes(adapter, resolution) -> dict:
    """Latent shape [C, F', h, w], tokens S, and the per-token linear weights N of one transformer."""
    c = adapter.transformer_config
    frames, height, width = resolution
    latent = (
        adapter.latent_channels,
        (frames - 1) // adapter.temporal_ratio + 1,
        height // adapter.spatial_ratio,
        width // adapter.spatial_ratio,
    )
    tokens = c["max_text_seq_length"] + latent[1] * (latent[2] // c["patch_size"]) * (
        latent[3] // c["patch_size"]
    )
    return {
        "latent": latent,
        "S": tokens,
        "L": c["num_layers"],
        "D": c["num_attention_heads"] * c["attention_head_dim"],
    }


def linear_weights(model) -> tuple[int, int]:
    """(N, N_lora): the block linears' base weights every token passes, and LoRA's weights.

    Base weights of the block linears every token passes (not the norms' timestep projections), and
    LoRA's weights."""
    n = 0
    for name, module in model.named_modules():
        if (
            ".transformer_blocks." in f".{name}"
            and isinstance(module, torch.nn.Linear)
            and ".norm" not in name
            and "lora_" not in name
        ):
            n += module.weight.numel()
    n_lora = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    return n, n_lora


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    adapter, model, batch, params, optimizer, compute, max_grad_norm, steps, device
) -> list[float]:
    """Time each of WARMUP + steps training steps, and the peak memory of the measured ones.

    Seconds of each of WARMUP + steps training steps (the trainer's: loss, backward, clip, AdamW),
    the peak memory counted from the first measured one."""
    times = []
    for i in range(WARMUP + steps):
        if i == WARMUP:
            memory.reset_peak_memory(device)
        synchronize(device)
        start = time.perf_counter()
        with compute:
            loss = adapter.train_loss(model, batch, [torch.Generator().manual_seed(i)]).mean()
        with compute.attention():
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def train_run(name: str, steps: int, smoke: bool, root: Path) -> dict:
    cfg, family, adapter, device = setup(name, smoke, root)
    # trainer's defaults
    model, params, optimizer, _ = build(cfg, family, adapter, None, device, foreach=None)
    s = sizes(adapter, cfg.data.train_resolution)
    n, n_lora = linear_weights(model)
    flops = 4 * n * s["S"] + 6 * n_lora * s["S"] + 12 * s["L"] * s["S"] ** 2 * s["D"]
    new = lambda shape: torch.randn(shape, device=device).to(adapter.dtype)
    batch = {
        "latent_mean": new((1, *s["latent"])),
        "latent_logvar": new((1, *s["latent"])),
        "prompt_embeds": new((1, adapter.text_length, adapter.transformer_config["text_embed_dim"])),
    }
    # as trainer.py applies it
    compute = parallel.Compute(device, "bf16", cfg.train.attention_backend)
    times = timed_steps(
        adapter, model, batch, params, optimizer, compute, cfg.train.max_grad_norm, steps, device
    )
    return {
        "s_per_step": sorted(times[WARMUP:])[len(times[WARMUP:]) // 2],
        "flops": flops,
        "tokens": s["S"],
        "warmup_s": sum(times[:WARMUP]),
        "peak_gb": memory.peak_memory_gb(device),
    }


def sampling_run(steps: int, smoke: bool, root: Path) -> dict:
    """Seconds per guided sampling step, ours and the pipeline's.

    Over `steps` steps after a 1-step warm-up each."""
    from diffusers import CogVideoXPipeline

    cfg, family, adapter, device = setup("sampling", smoke, root)
    transformer = meta_transformer(adapter, adapter.transformer_config, adapter.dtype).eval()
    materialize(transformer, None, device)
    s = sizes(adapter, cfg.data.train_resolution)
    n, _ = linear_weights(transformer)
    flops = 2 * (2 * n * s["S"] + 4 * s["L"] * s["S"] ** 2 * s["D"])
    text = (1, adapter.text_length, adapter.transformer_config["text_embed_dim"])
    embeds, negative = (
        torch.randn(text, device=device).to(adapter.dtype),
        torch.randn(text, device=device).to(adapter.dtype),
    )
    frames, height, width = cfg.data.train_resolution
    pipe = CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=adapter.sampler("")
    )
    pipe.set_progress_bar_config(disable=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def ours(k: int):
        vcfg = ValidationConfig(num_inference_steps=k)
        with torch.no_grad(), adapter.sampling_attention(transformer):
            return adapter.sampled(
                validate.sample_latents(
                    adapter,
                    {adapter.transformer_folder: transformer},
                    adapter.sampler(""),
                    embeds,
                    negative,
                    torch.Generator().manual_seed(0),
                    vcfg,
                    cfg.data.train_resolution,
                    autocast,
                )
            )

    def theirs(k: int):
        return pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=k,
            guidance_scale=ValidationConfig().guidance_scale,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).frames

    result = {"flops": flops, "tokens": s["S"]}
    for label, fn in (("ours", ours), ("pipeline", theirs)):
        fn(1)
        memory.reset_peak_memory(device)
        synchronize(device)
        start = time.perf_counter()
        latents = fn(steps)
        synchronize(device)
        result[label] = {
            "s_per_step": (time.perf_counter() - start) / steps,
            "peak_gb": memory.peak_memory_gb(device),
        }
        result[f"{label}_latents"] = latents.float().flatten()[:4096].cpu()
    result["max_diff"] = (result.pop("ours_latents") - result.pop("pipeline_latents")).abs().max().item()
    return result


def write_wan_14b(folder: Path, smoke: bool) -> None:
    """Write, once, the tiny Wan's folder with Wan 2.1 14B's transformer in random bf16 weights.

    Once: the tiny Wan's folder (VAE, text encoder, scheduler) with Wan 2.1 14B's transformer,
    random bf16 (28 GB on disk, drawn on the GPU where there is one; --smoke: 2 blocks of 2 heads).
    """
    if (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted write left
    make_tiny_wan(str(folder))
    shutil.rmtree(folder / "transformer")
    wan_14b, config = transformer_config("wan2.1-t2v-14b")
    write_random_transformer(
        folder / "transformer",
        wan_14b,
        {**config, **(SMOKE if smoke else {})},
        5 * 10**9,
        "cuda" if torch.cuda.is_available() else "cpu",
    )


def one_gpu_run(name: str, steps: int, smoke: bool, folder: Path) -> dict:
    """A Wan 14B LoRA r32 step with the one-card settings, through the trainer's own build.

    At 81x480x832 (--smoke: 9x64x64), through the adapter's loader, model.build_model and AdamW,
    with ONE_GPU's settings; the estimate of the same setting (bench_memory, bench/one_gpu.py)
    beside the measured peak."""
    settings = {
        "model.path": str(folder),
        "data.train_resolution": [9, 64, 64] if smoke else [81, 480, 832],
        **ONE_GPU[name],
    }
    # TOML literals
    literal = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    overrides = [f"--{key}={literal(value)}" for key, value in settings.items()]
    cfg = load_config(str(REPO / "configs" / "wan-t2v-14b.toml"), overrides)
    d = ranks.init(cfg.parallel)
    adapter = load_adapter(cfg.model, d.device)
    model = build_model(adapter, cfg.train, cfg.lora, cfg.parallel, cfg.run.seed, d)
    params, optimizer = build_optimizer(model, cfg.train)
    s = shapes(cfg, adapter, 1)
    new = lambda shape: torch.randn(shape, device=d.device).to(adapter.dtype)
    batch = cached_batch(adapter, s, new)
    compute = parallel.Compute(d.device, cfg.train.mixed_precision, cfg.train.attention_backend)
    times = timed_steps(
        adapter, model, batch, params, optimizer, compute, cfg.train.max_grad_norm, steps, d.device
    )
    peak, layers, keys = (
        memory.peak_memory_gb(d.device),
        adapter.transformer_config["num_layers"],
        ONE_GPU[name],
    )
    streamed = (keys.get("parallel.offload_blocks") or layers) if keys.get("parallel.cpu_offload") else 0
    setting = one_gpu.Setting(
        keys.get("model.storage_dtype") == "fp8", keys.get("train.activation_offload", False), streamed
    )
    # Pinned host memory as torch's host allocator counts it (every block it holds, cached ones too)
    # against --fit's host figure for the same setting (the pinned weights and the offloaded block
    # inputs).
    pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"] if d.device.type == "cuda" else None
    parts = estimate(cfg, adapter.FAMILY, adapter)
    estimated = one_gpu.training(parts, setting) / 2**30
    del model, params, optimizer
    # the model collected before the process group goes: FSDP2 may abort at exit otherwise
    command.shutdown()
    return {
        "s_per_step": sorted(times[WARMUP:])[len(times[WARMUP:]) // 2],
        "warmup_s": sum(times[:WARMUP]),
        "peak_gb": peak,
        "estimate_gib": estimated,
        "tokens": s["video_tokens"],
        "pinned_gib": pinned and pinned / 2**30,
        "pinned_estimate_gib": sum(one_gpu.pinned(parts, setting).values()) / 2**30,
    }


def one(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if name == "sampling":
                return sampling_run(args.sampling_steps, args.smoke, Path(tmp))
            if name in ONE_GPU:
                write_wan_14b(Path(args.folder), args.smoke)
                return one_gpu_run(name, args.steps, args.smoke, Path(args.folder))
            return train_run(name, args.steps, args.smoke, Path(tmp))
        except torch.OutOfMemoryError as e:
            return {"oom": str(e).splitlines()[0]}


def report(name: str, r: dict, peak_flops: float | None) -> None:
    mfu = lambda seconds: f"{100 * r['flops'] / seconds / peak_flops:5.1f}%" if peak_flops else "  n/a"
    if "oom" in r:
        print(f"{name:12} out of memory: {r['oom']}")
    elif name == "sampling":
        for label in ("ours", "pipeline"):
            x = r[label]
            print(
                f"{name:12} {label:8} {x['s_per_step']:7.3f} s/step  MFU {mfu(x['s_per_step'])}  "
                f"peak {x['peak_gb']:6.1f} GB"
            )
        print(
            f"{'':12} pipeline / ours {r['pipeline']['s_per_step'] / r['ours']['s_per_step']:.3f}x; "
            f"{r['tokens']} tokens; largest latent difference {r['max_diff']:.2e}"
        )
    elif name in ONE_GPU:
        print(
            f"{name:12} {r['s_per_step']:7.3f} s/step  peak {r['peak_gb']:6.1f} GB, estimated {r['estimate_gib']:.1f} "
            f"({r['tokens']} video tokens, warm-up {r['warmup_s']:.0f} s)"
        )
        pinned = "n/a (no CUDA)" if r["pinned_gib"] is None else f"{r['pinned_gib']:.2f} GiB"
        print(f"{'':12} pinned host memory {pinned}, estimated {r['pinned_estimate_gib']:.2f} GiB")
    else:
        print(
            f"{name:12} {r['s_per_step']:7.3f} s/step  MFU {mfu(r['s_per_step'])}  peak {r['peak_gb']:6.1f} GB  "
            f"({r['tokens']} tokens, {r['flops'] / 1e12:.3g} TFLOP/step, warm-up {r['warmup_s']:.0f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="timed training steps (the median is reported)")
    parser.add_argument("--sampling-steps", type=int, default=4)
    parser.add_argument(
        "--peak-tflops", type=float, help="the chip's dense bf16 peak (default: 989 on H100/H200)"
    )
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, 1 step: checks the code only")
    parser.add_argument(
        "--folder",
        help="where the 14b configurations' model is written once and reused "
        "(28 GB; default /tmp/vidtrain-bench-gpu-wan14b, -smoke with --smoke)",
    )
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    args.folder = args.folder or f"/tmp/vidtrain-bench-gpu-wan14b{'-smoke' if args.smoke else ''}"
    if args.smoke:
        args.steps = args.sampling_steps = 1
        # CUDA kernels only
        args.only = [n for n in args.only if not CONFIGS[n][1].get("attention_backend")]
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    peak = args.peak_tflops
    if (
        peak is None
        and torch.cuda.is_available()
        and any(c in torch.cuda.get_device_name() for c in ("H100", "H200"))
    ):
        peak = 989.0
    device = "cpu (smoke: figures mean nothing)" if args.smoke else torch.cuda.get_device_name()
    print(
        f"{device}; bf16 peak {peak or 'unknown'} TFLOPS; batch 1 at {'9x64x64' if args.smoke else '49x480x720'}, "
        f"LoRA rank 128 (14b: Wan at {'9x64x64' if args.smoke else '81x480x832'}, rank 32); median of "
        f"{args.steps} steps after {WARMUP}"
    )
    results = {}
    for name in args.only:
        child = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--steps",
            str(args.steps),
            "--folder",
            args.folder,
            "--sampling-steps",
            str(args.sampling_steps),
            *(["--smoke"] if args.smoke else []),
        ]
        run = subprocess.run(child, capture_output=True, text=True)
        if run.returncode:
            print(f"{name:12} failed:\n{run.stderr[-3000:]}")
            continue
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
        report(name, results[name], peak and peak * 1e12)
        baseline = results.get("5b-lora", {}).get("s_per_step")
        if CONFIGS[name][1].get("attention_backend") and baseline and "s_per_step" in results[name]:
            print(f"{'':12} {results[name]['s_per_step'] / baseline:.3f}x 5b-lora's time (SDPA's own choice)")
        resident = results.get("14b-resident", {}).get("s_per_step")
        if name == "14b-one-gpu" and resident and "s_per_step" in results[name]:
            print(
                f"{'':12} {results[name]['s_per_step'] / resident:.3f}x 14b-resident's time: the cost of streaming, "
                "fp8 upcasts and activation offload"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
