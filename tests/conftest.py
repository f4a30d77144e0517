"""Shared test harness: the tiny model, the synthetic dataset and its cache are built once per
session.

Tests run the real commands (`python trainer.py`, `torchrun ... trainer.py`) as subprocesses, so the
configs, the loading code and the process-group setup under test are the ones users run.
"""

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers.models import modeling_utils

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import cache  # noqa: E402
import ranks  # noqa: E402
import trainer  # noqa: E402
from config import LoraConfig, ParallelConfig, TrainConfig, load_config, toml_value  # noqa: E402
from families.hunyuanvideo15 import GLYPH_LENGTH, TEXT_LENGTH  # noqa: E402
from model import build_model, setup_adapter  # noqa: E402
from model_adapter import load_adapter, padded_text  # noqa: E402
from tools.make_synthetic_dataset import make_synthetic_dataset, write_clip  # noqa: E402
from tools.make_tiny_model import TINY  # noqa: E402


def written_on_first_use(root: Path, make):
    """get(variant): the folder make(folder, variant) writes under root, written on the first call."""
    made = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = root / variant
            make(str(made[variant]), variant)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family_models(family)(variant): a registered family's tiny model (tools/make_tiny_model.TINY),
    written on first use, so a new family's tests need no fixture of their own."""
    root = tmp_path_factory.mktemp("families")
    makers = {family: written_on_first_use(root / family, make) for family, (_, _, make) in TINY.items()}
    return makers.__getitem__


@pytest.fixture(scope="session")
def tiny_models(family_models):
    """Every published CogVideoX variant's tiny model, written on first use."""
    return family_models("cogvideox")


@pytest.fixture(scope="session")
def wan_models(family_models):
    """Every Wan variant's tiny model, written on first use."""
    return family_models("wan")


@pytest.fixture(scope="session")
def ltx2_models(family_models):
    """Each LTX-2 variant's tiny model, written on first use."""
    return family_models("ltx2")


@pytest.fixture(scope="session")
def ltx2_data(tmp_path_factory):
    """Six clips: Gemma 3 reads 1024 tokens per prompt, so the cache pass over the session's 24
    would dominate."""
    path = tmp_path_factory.mktemp("ltx2_data") / "shapes"
    make_synthetic_dataset(str(path), num_videos=6, frames=17, height=40, width=48, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    """The session's model: CogVideoX-2b's key set (no rotary embeddings, sincos positions)."""
    return tiny_models("2b")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "shapes"
    make_synthetic_dataset(str(path), num_videos=24, frames=17, height=40, width=48, seed=0)
    return path


def write_toml(path: Path, settings: dict) -> Path:
    """{"section.key": value} -> a TOML file at path."""
    sections: dict[str, list[str]] = {}
    for key, value in settings.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n\n" for s, lines in sections.items()))
    return path


@pytest.fixture(scope="session")
def base_settings(tiny_model, tiny_data, tmp_path_factory) -> dict:
    """The settings every test starts from: fp32 and fast, a cache shared by the whole session."""
    return {
        "model.path": str(tiny_model),
        "model.dtype": "fp32",
        "data.data_root": str(tiny_data),
        "data.train_resolution": [9, 32, 32],
        "data.cache_dir": str(tmp_path_factory.mktemp("cache")),
        "data.held_out": 4,
        "train.steps": 6,
        "train.batch_size": 2,
        "train.learning_rate": 1e-3,
        "train.lr_warmup_steps": 2,
        "train.log_every": 1,  # the tests compare every step's loss
        "train.mixed_precision": "no",
        "train.gradient_checkpointing": False,
        "lora.rank": 4,
        "lora.lora_alpha": 2,
        "checkpoint.checkpointing_steps": 3,
        "validation.validation_steps": 3,
    }


@pytest.fixture
def write_config(base_settings, tmp_path):
    """write_config(name, **{"section.key": value}) -> path of a TOML file; output_dir under
    tmp_path."""

    def write(name: str = "run", **settings) -> Path:
        settings = {"run.output_dir": str(tmp_path / name), **base_settings, **settings}
        return write_toml(tmp_path / f"{name}.toml", settings)

    return write


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: list[str], nproc: int, env: dict | None, script: str) -> tuple[list[str], dict]:
    """One of our commands: in one process, through torchrun, or through launch.sh (NPROC processes;
    its arguments are the config file, then overrides)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    if script == "launch.sh":
        return ["bash", str(REPO / script), *args], {**full_env, "NPROC": str(nproc)}
    if nproc == 1:
        return [sys.executable, str(REPO / script), *args], full_env
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(REPO / script),
        *args,
    ], full_env


def default_sigint() -> None:
    """A job started in the background by a non-interactive shell (as CI may be) ignores SIGINT, and
    so would the trainer it starts: the child gets the default disposition, as under a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cmd(
    args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 300, script: str = "trainer.py"
):
    """Run one of our commands, in one process or through torchrun; return the CompletedProcess."""
    cmd, full_env = command(args, nproc, env, script)
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=default_sigint,
    )


def start_paused(args: list[str], fault: str, nproc: int = 1, script: str = "trainer.py"):
    """Start a command with a `pause` fault (faults.pause) in a session of its own, as a terminal or
    a scheduler starts a job; return the process, the pid of the paused rank and the output so far,
    once it has paused. Signal the whole job with os.killpg(process.pid, ...), then finish(process,
    output)."""
    cmd, full_env = command(args, nproc, {"VIDTRAIN_FAULT": fault}, script)
    process = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    output = []
    for line in process.stdout:
        output.append(line)
        if paused := re.search(r"\(pid (\d+)\) paused at", line):
            return process, int(paused.group(1)), output
    process.wait()
    raise AssertionError(f"never paused (exit {process.returncode}):\n{''.join(output)[-4000:]}")


def finish(process, output: list[str], timeout: int = 300) -> tuple[int, str]:
    """The exit code and whole output of a process start_paused started."""
    output.append(process.communicate(timeout=timeout)[0])
    return process.returncode, "".join(output)


def run_read_only(
    folders: list[Path], args: list[str], nproc: int = 1, script: str = "trainer.py", timeout: int = 300
):
    """Run one of our commands with `folders` read-only: for root, whom permissions do not stop, as
    a read-only bind mount in a mount namespace of the command's own (unshare); for other users by
    their permissions."""
    cmd, env = command(args, nproc, None, script)
    if os.geteuid() != 0:
        modes = {folder: folder.stat().st_mode for folder in folders}
        try:
            for folder in folders:
                folder.chmod(0o555)
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        finally:
            for folder, mode in modes.items():
                folder.chmod(mode)
    mounts = " && ".join(
        f"mount --bind {f} {f} && mount -o remount,bind,ro {f}" for f in map(shlex.quote, map(str, folders))
    )
    return subprocess.run(
        ["unshare", "--mount", "bash", "-c", f'{mounts} && exec "$@"', "bash", *cmd],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_worker(source: str, folder: Path, *args, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """A worker script (`source`) written into `folder` and run on 2 ranks by torchrun, one thread a
    rank, with the repository as its first argument and `args` after it; `env` adds variables."""
    script = folder / "worker.py"
    script.write_text(source)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            str(script),
            str(REPO),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def run_ok(*args, **kwargs):
    result = run_cmd(*args, **kwargs)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    )
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [
        json.loads(line) for line in (Path(output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    ]


def train_losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(output_dir) if "train/loss" in m}


def assert_loads_lean(adapter, monkeypatch, folder: str = "") -> None:
    """adapter.load_transformer with accelerate hidden (requirements.txt does not list it; without
    it from_pretrained allocates every weight for real, and refuses Wan): every parameter is
    registered on the meta device (so no initialisation touches memory), and the result equals
    from_pretrained's (with accelerate) tensor for tensor, dtypes, buffers and eval mode included."""
    folder = folder or adapter.transformer_folder
    reference = adapter.TRANSFORMER.from_pretrained(adapter.path, subfolder=folder, dtype=adapter.dtype)
    on_meta, register = [], torch.nn.Module.register_parameter

    def record(module, name, param):
        on_meta.append(param is None or param.is_meta)
        register(module, name, param)

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "accelerate", None)  # `import accelerate` raises ImportError
        m.setattr(modeling_utils, "is_accelerate_available", lambda: False)
        m.setattr(torch.nn.Module, "register_parameter", record)
        ours = adapter.load_transformer(folder=folder)
    assert on_meta and all(on_meta), f"{on_meta.count(False)} parameters registered off the meta device"
    theirs = {**dict(reference.named_buffers()), **dict(reference.named_parameters())}
    mine = {**dict(ours.named_buffers()), **dict(ours.named_parameters())}
    assert mine.keys() == theirs.keys()
    different = [k for k in theirs if mine[k].dtype != theirs[k].dtype or not torch.equal(mine[k], theirs[k])]
    assert different == [] and not ours.training


@contextlib.contextmanager
def one_rank_group():
    """A one-rank process group, as trainer.py makes without torchrun (not held across trainer.main,
    which makes and destroys its own)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ranks.Dist(0, 1, 0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def fsdp_frozen_weights(adapter) -> dict[str, torch.Tensor]:
    """The frozen weights a one-rank FSDP build reads into its shards (LoRA r2 beside them), whole."""
    train = TrainConfig(mixed_precision="no", gradient_checkpointing=False)
    with one_rank_group() as d:
        model = build_model(adapter, train, LoraConfig(rank=2), ParallelConfig(strategy="fsdp"), 0, d)
        return {
            k: v.full_tensor()
            for k, v in model.named_parameters()
            if isinstance(v, torch.distributed.tensor.DTensor) and "lora_" not in k
        }


def prepare_run(cfg, d: ranks.Dist):
    """The trainer's first two steps: the checked adapter, then the cache pass over every clip.
    Returns (adapter, cache, training items, held-out items)."""
    adapter = setup_adapter(cfg, d)
    return (adapter, *cache.prepare(cfg, adapter, d))


def lora_and_sft_runs(settings: dict, tmp_path):
    """Two steps of LoRA with `settings` (under tmp_path/lora) and two of sft beside it
    (tmp_path/sft): the exported LoRA file, the LoRA run's config and its adapter (the family
    template's runs)."""
    trainer.main(["--cfg", str(write_toml(tmp_path / "lora.toml", settings))])
    sft = {
        **settings,
        "run.output_dir": str(tmp_path / "sft"),
        "train.training_type": "sft",
        "train.learning_rate": 1e-3,
    }
    trainer.main(["--cfg", str(write_toml(tmp_path / "sft.toml", sft))])
    cfg = load_config(str(tmp_path / "lora.toml"))
    lora_file = tmp_path / "lora" / "lora" / "pytorch_lora_weights.safetensors"
    return lora_file, cfg, load_adapter(cfg.model, torch.device("cpu"))


def decode_mp4(path):
    """PyAV's frames [F, H, W, 3] (uint8) of an mp4 and its stream's average rate."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = torch.stack(
            [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
        )
        return frames, stream.average_rate


def comfyui_linears(c: dict) -> dict[str, tuple[int, int]]:
    """ComfyUI's native CogVideoX model's linear layers, as (in, out) features.

    The nn.Linear modules, as (in, out) features, of ComfyUI's native CogVideoX model for a
    diffusers transformer config, written from comfy/ldm/cogvideo/model.py (CogVideoXBlock,
    CogVideoXPatchEmbed, CogVideoXLayerNormZero, CogVideoXAdaLayerNorm,
    CogVideoXTransformer3DModel.__init__) as read at comfyanonymous/ComfyUI
    955ce480e27210cc7c0ea007f017077a2c539b81 (the same in yzkee/ComfyUI, a copy of upstream to Aug
    2026, at 783545f689a0af730065994b46b382ae24844c99). ComfyUI converts no diffusers keys for
    CogVideoX (comfy/model_detection.py detects it by blocks.0.norm1.linear.weight), and its LoRA
    loader (comfy/lora.py model_lora_keys_unet) patches `diffusion_model.<module>.weight` from
    `diffusion_model.<module>.lora_A/lora_B.weight` with `.alpha` (comfy/weight_adapter/lora.py)."""
    dim, time = c["num_attention_heads"] * c["attention_head_dim"], c["time_embed_dim"]
    p, pt = c["patch_size"], c["patch_size_t"]
    block = {
        "norm1.linear": (time, 6 * dim),
        "q": (dim, dim),
        "k": (dim, dim),
        "v": (dim, dim),
        "attn_out": (dim, dim),
        "norm2.linear": (time, 6 * dim),
        "ff_proj": (dim, 4 * dim),
        "ff_out": (4 * dim, dim),
    }
    linears = {f"blocks.{i}.{name}": shape for i in range(c["num_layers"]) for name, shape in block.items()}
    linears |= {
        "patch_embed.text_proj": (c["text_embed_dim"], dim),
        "time_embedding_linear_1": (dim, time),
        "time_embedding_linear_2": (time, time),
        "norm_out.linear": (time, 2 * dim),
        "proj_out": (dim, p * p * (pt or 1) * c["out_channels"]),
    }
    if pt:  # 1.5: the patch embedding is a Linear (a Conv2d in 1.0)
        linears["patch_embed.proj"] = (c["in_channels"] * p * p * pt, dim)
    if c["ofs_embed_dim"]:
        linears |= {
            "ofs_embedding_linear_1": (c["ofs_embed_dim"],) * 2,
            "ofs_embedding_linear_2": (c["ofs_embed_dim"],) * 2,
        }
    return linears


# LTX-2's runs, shared by the LTX-2 modules.
LTX2_PROMPTS = ["a red circle moves right"]
# The LTX-2 pipelines' own guidance terms at their defaults.
PIPELINE_GUIDANCE = {"audio_guidance_scale": 7.0, "modality_scale": 3.0, "guidance_rescale": 0.7}


def ltx2_settings(variant, ltx2_models, base_settings, tiny_data, output_dir, **extra) -> dict:
    """Two video-only steps of LTX-2 `variant` ("2.0", "2.3-i2v": 2.3's model for image-to-video)."""
    model_type = "i2v" if variant.endswith("i2v") else "t2v"
    model = ltx2_models(variant.split("-")[0])
    settings = {
        **base_settings,
        "run.output_dir": str(output_dir),
        "model.path": str(model),
        "model.family": "ltx2",
        "model.type": model_type,
        "data.data_root": str(tiny_data),
        "data.held_out": 2,
        "data.audio": False,  # video only: these clips have no sound
        "train.steps": 2,
        "train.learning_rate": 1e-2,
        "train.lr_warmup_steps": 1,
        "validation.do_validation": False,
        "validation.prompts": LTX2_PROMPTS,
        "validation.num_inference_steps": 2,
        "validation.gen_fps": 24,
    }
    if model_type == "i2v":
        settings["validation.images"] = [
            str(tiny_data / "images" / f"0000{i}.png") for i in range(len(LTX2_PROMPTS))
        ]
    return {**settings, **extra}


def pipeline_guidance(cfg) -> dict:
    """The pipelines' guidance arguments for validation's settings (each term on both streams, as
    ours)."""
    return dict(
        guidance_scale=cfg.guidance_scale,
        audio_guidance_scale=cfg.audio_guidance_scale or cfg.guidance_scale,
        stg_scale=cfg.stg_scale,
        audio_stg_scale=cfg.stg_scale,
        spatio_temporal_guidance_blocks=cfg.stg_blocks,
        modality_scale=cfg.modality_scale,
        audio_modality_scale=cfg.modality_scale,
        guidance_rescale=cfg.guidance_rescale,
        audio_guidance_rescale=cfg.guidance_rescale,
    )


def ltx_core_cross_inputs(model, video_t, video_sigma, audio_t, audio_sigma) -> dict[str, torch.Tensor]:
    """The audio-video cross-attention's AdaLN inputs as ltx-core computes them.

    The four audio-video cross-attention AdaLN inputs as Lightricks/LTX-2's packages/ltx-core
    model/transformer/transformer_args.py computes them (MultiModalTransformerArgsPreprocessor.
    _prepare_cross_attention_timestep, called per modality with the other as cross_modality):
    scale/shift = cross_scale_shift_adaln(modality.timesteps x timestep_scale_multiplier), per
    token; gate = cross_gate_adaln(cross_modality.sigma x timestep_scale_multiplier x av_ca_factor),
    av_ca_factor = av_ca_timestep_scale_multiplier / timestep_scale_multiplier. The arguments here
    are what diffusers' transformer takes (timestep_scale_multiplier already applied: 1000 s).
    ltx-core's modules (model/transformer/model.py) are diffusers' av_cross_attn_*:
    video_scale_shift, video_a2v_gate, audio_scale_shift, audio_v2a_gate."""
    factor = model.config.cross_attn_timestep_scale_multiplier / model.config.timestep_scale_multiplier
    batch, dtype = len(video_sigma), model.proj_in.weight.dtype

    def adaln(module, t):
        out = module(t.flatten(), batch_size=batch, hidden_dtype=dtype)[0]
        return out.view(batch, -1, out.shape[-1])

    return {
        "temb_ca_scale_shift": adaln(model.av_cross_attn_video_scale_shift, video_t),
        "temb_ca_audio_scale_shift": adaln(model.av_cross_attn_audio_scale_shift, audio_t),
        "temb_ca_gate": adaln(model.av_cross_attn_video_a2v_gate, audio_sigma * factor),
        "temb_ca_audio_gate": adaln(model.av_cross_attn_audio_v2a_gate, video_sigma * factor),
    }


@contextlib.contextmanager
def ltx_core_cross_modulation(model):
    """diffusers' transformer `model` with ltx-core's cross-attention modulation: each call's four
    inputs (ltx_core_cross_inputs, from the call's timesteps and sigmas) replace what every block is
    given."""
    inputs = {}

    def on_call(module, args, kwargs):
        timestep, sigma = kwargs["timestep"], kwargs.get("sigma", kwargs["timestep"])
        audio_t = kwargs.get("audio_timestep")
        audio_t = timestep if audio_t is None else audio_t
        audio_sigma = kwargs.get("audio_sigma")
        inputs.update(
            ltx_core_cross_inputs(
                module, timestep, sigma, audio_t, sigma if audio_sigma is None else audio_sigma
            )
        )

    def on_block(module, args, kwargs):
        return args, {**kwargs, **inputs}

    hooks = [model.register_forward_pre_hook(on_call, with_kwargs=True)]
    hooks += [
        block.register_forward_pre_hook(on_block, with_kwargs=True) for block in model.transformer_blocks
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def ramp_clip(path: Path, frames: int, height: int = 32, width: int = 32, kind: str = "mp4") -> None:
    """Frame k is flat grey 10 + 12k (the decoded value tells which frame was picked), with a white
    top-left corner (it tells which way up the frame is)."""
    video = np.stack([np.full((height, width, 3), 10 + 12 * k, np.uint8) for k in range(frames)])
    video[:, : height // 4, : width // 4] = 255
    write_clip(path, video, 8, kind)


def picked_frames(video: torch.Tensor) -> list[int]:
    """The ramp's frame index from the grey away from the corner."""
    h, w = video.shape[1:3]
    return [round((v - 10) / 12) for v in video[:, h // 2 :, w // 2 :].float().mean(dim=(1, 2, 3)).tolist()]


def ramp_video(path, frames: int, height: int, width: int, fps: int, step: float, mark: int = 0) -> None:
    """Frame k is flat grey 10 + step x k (the decoded grey tells which frame was picked), with a
    white top-left corner (it tells how the frame was resized and cropped) and a top-right one of
    grey `mark` (clips of other content: other windows and crops)."""
    video = np.stack([np.full((height, width, 3), round(10 + step * k), np.uint8) for k in range(frames)])
    video[:, : height // 4, : width // 4] = 255
    video[:, : height // 4, -width // 4 :] = mark
    write_clip(path, video, fps)


def original_top_level_linears(c: dict) -> set[str]:
    """The original LTX-2 transformer's linear layers outside the blocks.

    The nn.Linear modules outside the blocks of the original LTX-2 transformer, whose names
    Lightricks' checkpoints and ComfyUI's native model (which loads those checkpoints' keys as they
    are) share, for a diffusers transformer config. Written from Lightricks/LTX-2
    400fd31054597515f47125691032c04b1c3ee24e,
    packages/ltx-core/src/ltx_core/model/transformer/model.py (LTXModel._init_video, _init_audio,
    _init_audio_video: prompt_adaln_single only with cross_attention_adaln, 2.3's cross_attn_mod;
    the caption projections only where the transformer projects the text, 2.0's
    use_prompt_embeddings), adaln.py (AdaLayerNormSingle: emb, linear), timestep_embedding.py
    (emb.timestep_embedder.linear_1/_2), text_projection.py (linear_1, linear_2); the same names in
    comfyanonymous/ComfyUI b321b7a28d7c62626f728db1c67555637d080a76,
    comfy/ldm/lightricks/av_model.py (LTXAVModel)."""
    adaln = ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear")
    modulations = [
        "adaln_single",
        "audio_adaln_single",
        "av_ca_video_scale_shift_adaln_single",
        "av_ca_audio_scale_shift_adaln_single",
        "av_ca_a2v_gate_adaln_single",
        "av_ca_v2a_gate_adaln_single",
    ]
    if c["cross_attn_mod"]:
        modulations += ["prompt_adaln_single", "audio_prompt_adaln_single"]
    names = {f"{m}.{part}" for m in modulations for part in adaln}
    names |= {"patchify_proj", "audio_patchify_proj", "proj_out", "audio_proj_out"}
    if c["use_prompt_embeddings"]:
        names |= {
            f"{p}.{layer}"
            for p in ("caption_projection", "audio_caption_projection")
            for layer in ("linear_1", "linear_2")
        }
    return names


# musubi-tuner's LoRA targets (networks/lora_kandinsky.py): every linear layer of the text and
# visual blocks but the modulations.
K5_TARGETS = [
    "self_attention.to_query",
    "self_attention.to_key",
    "self_attention.to_value",
    "self_attention.out_layer",
    "cross_attention.to_query",
    "cross_attention.to_key",
    "cross_attention.to_value",
    "cross_attention.out_layer",
    "feed_forward.in_layer",
    "feed_forward.out_layer",
]


def k5_batch() -> dict:
    """A cached batch of two clips (3 latent frames of 2 x 6) and two prompts of 7 and 5 Qwen rows."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(512)[None] < torch.tensor([[7], [5]])
    return {
        "latent_mean": torch.randn(2, 4, 3, 2, 6, generator=g),
        "latent_logvar": torch.randn(2, 4, 3, 2, 6, generator=g) - 3,
        "prompt_embeds_qwen": torch.randn(2, 512, 32, generator=g) * mask[..., None],
        "prompt_embeds_qwen_mask": mask,
        "prompt_embeds_clip": torch.randn(2, 1, 32, generator=g),
        "prompt_embeds_clip_mask": torch.ones(2, 1, dtype=torch.bool),
    }


def hv_batch() -> dict:
    """A cached image-to-video batch of one clip (3 latent frames of 2 x 2), its SigLIP tokens and
    both texts (7 Qwen2.5-VL rows, 3 ByT5 rows), padded as the cache gives them back."""
    g = torch.Generator().manual_seed(0)
    text = padded_text(
        {
            "prompt_embeds": torch.randn(7, 32, generator=g),
            "prompt_embeds_2": torch.randn(3, 16, generator=g),
        },
        {"prompt_embeds": TEXT_LENGTH, "prompt_embeds_2": GLYPH_LENGTH},
    )
    return {
        "latent_mean": torch.randn(1, 4, 3, 2, 2, generator=g),
        "latent_logvar": torch.randn(1, 4, 3, 2, 2, generator=g) - 3,
        "image_embeds": torch.randn(1, 16, 16, generator=g),
        **{k: v[None] for k, v in text.items()},
    }
