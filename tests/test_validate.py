"""validate.py's clips: the pipeline's frames, spread over ranks, reproducible, harmless.

They equal CogVideoXPipeline's, are spread over ranks, written to mp4 and TensorBoard, reproducible
from checkpoints and LoRA files, and invisible to training."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from conftest import decode_mp4, read_metrics, run_cmd, run_ok, train_losses, write_toml
from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline
from PIL import Image
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import T5EncoderModel

import cache
import ckpt
import data
import lora
import ranks
import render
import trainer
import validate
from config import ConfigError, DataConfig, ModelConfig, ValidationConfig, load_config
from model_adapter import load_adapter

PROMPTS = ["a red ball moves left", "a blue square drifts up slowly", "a small green circle bounces"]
FPS = 12
RUN = {
    "train.steps": 4,
    "train.learning_rate": 1e-2,
    "train.ema_decay": 0.5,
    "checkpoint.checkpointing_steps": 2,
    "validation.validation_steps": 2,
    "validation.prompts": PROMPTS,
    "validation.num_inference_steps": 8,
    "validation.gen_fps": FPS,
    "validation.save_frames": True,
}
# FSDP keeping gathered weights after forward: the setting in which validation's EMA swap once
# leaked into training.
FSDP = {"parallel.strategy": "fsdp", "train.batch_size": 1, "parallel.reshard_after_forward": False}


@pytest.fixture(scope="module")
def runs(base_settings, tmp_path_factory):
    """Four short LoRA runs with EMA and one global batch of 2: validated every 2 steps and not at
    all, in one process and on 2 FSDP ranks."""
    root = tmp_path_factory.mktemp("validate_runs")
    variants = {
        "one": ({}, 1),
        "plain": ({"validation.do_validation": False}, 1),
        "fsdp": (FSDP, 2),
        "fsdp_plain": ({**FSDP, "validation.do_validation": False}, 2),
    }
    for name, (settings, nproc) in variants.items():
        cfg = write_toml(
            root / f"{name}.toml", {**base_settings, **RUN, "run.output_dir": str(root / name), **settings}
        )
        run_ok(["--cfg", str(cfg)], nproc=nproc)
    return root


def frames_of(path) -> torch.Tensor:
    """The uint8 frames [F, H, W, 3] a clip's mp4 was encoded from (validation.save_frames)."""
    return load_file(path.with_suffix(".safetensors"))["frames"]


@pytest.fixture(scope="module")
def one_process_group():
    """validate's rendering gathers to rank 0: a one-rank group, as trainer.py makes without
    torchrun."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ranks.Dist(0, 1, 0, torch.device("cpu"))
    dist.destroy_process_group()


def validation_steps(output_dir) -> list[int]:
    return [m["step"] for m in read_metrics(output_dir) if "val/time_s" in m]


def lora_files(output_dir, folder="lora"):
    return load_file(output_dir / folder / "pytorch_lora_weights.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("validated, plain", [("one", "plain"), ("fsdp", "fsdp_plain")])
def test_training_is_not_disturbed(runs, validated, plain):
    """Validation leaves the training losses and the final weights bitwise unchanged.

    Validation every 2 steps, with the EMA weights swapped in, leaves the training losses and the
    final LoRA and EMA bitwise unchanged."""
    assert validation_steps(runs / validated) and not validation_steps(runs / plain)
    assert train_losses(runs / validated) == train_losses(runs / plain)
    for folder in ("lora", "lora_ema"):
        ours, theirs = lora_files(runs / validated, folder), lora_files(runs / plain, folder)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), folder
    assert all(
        m["val/peak_mem_gb"] > 0 and m["val/time_s"] > 0
        for m in read_metrics(runs / validated)
        if "val/time_s" in m
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one", "fsdp"])
def test_clips_in_mp4_and_tensorboard(runs, name):
    """One mp4 and one TensorBoard clip per prompt per validation, decoding to their frames.

    One mp4 and one playable TensorBoard clip per prompt per validation, with the configured frames
    and fps; the mp4 decodes to the frames it was encoded from, within the encoder's loss (yuv420p
    halves the colour resolution, so the random model's noisy clips are compared in luma)."""
    out = runs / name
    steps = validation_steps(out)
    assert {2, 4} <= set(steps)
    expected = {
        f"step_{s}_prompt_{i}.{ext}"
        for s in steps
        for i in range(len(PROMPTS))
        for ext in ("mp4", "safetensors")
    }
    assert {p.name for p in (out / "validation_res").iterdir()} == expected
    for file in (f for f in expected if f.endswith(".mp4")):
        frames, rate = decode_mp4(out / "validation_res" / file)
        assert frames.shape == (9, 32, 32, 3) and rate == FPS
        assert (luma(frames) - luma(frames_of(out / "validation_res" / file))).abs().mean() < 12
    events = EventAccumulator(str(out / "logs"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    for i, prompt in enumerate(PROMPTS):
        clips = events.Images(f"val/clip_{i}")
        assert sorted(c.step for c in clips) == sorted(steps)
        with Image.open(io.BytesIO(clips[-1].encoded_image_string)) as gif:
            # GIF counts in 10 ms
            assert gif.format == "GIF" and gif.n_frames == 9 and abs(gif.info["duration"] - 1000 / FPS) < 10
        texts = events.Tensors(f"val/prompt_{i}/text_summary")
        assert [t.step for t in texts] == [c.step for c in clips]
        assert texts[0].tensor_proto.string_val[0].decode() == prompt


def luma(frames: torch.Tensor) -> torch.Tensor:
    return frames.float() @ torch.tensor([0.299, 0.587, 0.114])


def clip_of(output_dir, name: str) -> torch.Tensor:
    return frames_of(output_dir / "validation_res" / f"{name}.mp4")


def render_of(output_dir, name: str):
    """The one render named {name}_{hash}.mp4 (render.render_names)."""
    [path] = (output_dir / "validation_res").glob(f"{name}_????????.mp4")
    return path


@pytest.mark.slow
def test_fsdp_clips_equal_one_process(runs):
    """2 FSDP ranks render the clips one process renders.

    2 FSDP ranks (3 prompts: one rank renders a padding clip) render the clips one process renders:
    the weights differ only by the summation order of the sharded reduction, so the frames agree
    within a few levels, where another prompt's clip differs by tens."""
    for step in validation_steps(runs / "one"):
        for i in range(len(PROMPTS)):
            one, two = (
                clip_of(runs / "one", f"step_{step}_prompt_{i}"),
                clip_of(runs / "fsdp", f"step_{step}_prompt_{i}"),
            )
            other = clip_of(runs / "one", f"step_{step}_prompt_{(i + 1) % 3}")
            assert (one.float() - two.float()).abs().mean() < 2
            assert (one.float() - other.float()).abs().mean() > 10


@pytest.mark.slow
def test_render_command_reproduces_training_clips(runs):
    """The render command reproduces the training clips.

    `render.py --checkpoint` (render.py's command) renders the training clip exactly (with the EMA
    weights, as validation does); `--online` and the exported LoRA, in one process or on 2 FSDP
    ranks, render the online weights."""
    out, cfg = runs / "one", str(runs / "one.toml")
    lora_file = out / "lora" / "pytorch_lora_weights.safetensors"
    # one command, two names
    for extra, script in (([], "render.py"), (["--online"], "render.py")):
        run_ok(
            ["--cfg", cfg, "--checkpoint", str(out / "checkpoint-4"), "--prompt", PROMPTS[0], *extra],
            script=script,
        )
    training = clip_of(out, "step_4_prompt_0")
    assert torch.equal(frames_of(render_of(out, "render_checkpoint-4_prompt_0")), training)
    online = frames_of(render_of(out, "render_checkpoint-4_online_prompt_0"))
    assert not torch.equal(online, training)  # EMA and online weights differ
    for overrides, nproc in (([], 1), (FSDP_OVERRIDES, 2)):
        run_ok(
            ["--cfg", cfg, "--lora", str(lora_file), "--prompt", PROMPTS[0], *overrides],
            nproc=nproc,
            script="render.py",
        )
        assert torch.equal(frames_of(render_of(out, "render_pytorch_lora_weights_prompt_0")), online)
    _, rate = decode_mp4(render_of(out, "render_checkpoint-4_prompt_0"))
    assert rate == FPS


FSDP_OVERRIDES = ["--parallel.strategy", "fsdp", "--train.batch_size", "1"]


@pytest.mark.slow
def test_sigterm_during_a_render_stops_with_a_checkpoint(runs, base_settings, tmp_path):
    """SIGTERM during a validation render stops every rank with a checkpoint.

    SIGTERM at sampling step 30 of the process (step 2's validation: step 0's took 3 clips x 8
    steps) stops every rank there with step 2's checkpoint, exit 0; the next launch ends exactly as
    the run that was never stopped, clips included."""
    cfg = write_toml(
        tmp_path / "stopped.toml", {**base_settings, **RUN, "run.output_dir": str(tmp_path / "stopped")}
    )
    stopped = run_ok(["--cfg", str(cfg)], env={"VIDTRAIN_FAULT": "render_sigterm:30"})
    assert "stopped by a signal: after step 2, checkpoint written" in stopped.stderr
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "stopped")] == ["checkpoint-2"]
    run_ok(["--cfg", str(cfg)])
    assert train_losses(tmp_path / "stopped") == train_losses(runs / "one")
    for folder in ("lora", "lora_ema"):
        ours, theirs = lora_files(tmp_path / "stopped", folder), lora_files(runs / "one", folder)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), folder
    for i in range(len(PROMPTS)):
        assert torch.equal(
            clip_of(tmp_path / "stopped", f"step_4_prompt_{i}"), clip_of(runs / "one", f"step_4_prompt_{i}")
        )


@pytest.mark.slow
def test_encoders_load_once_per_run(write_config, tmp_path, monkeypatch):
    """The encoders load once per run.

    Four validations, one VAE load: it is parked on the CPU between them; T5 encodes the prompts
    once."""
    config = write_config(
        "loads",
        **{
            "train.steps": 3,
            "validation.validation_steps": 1,
            "validation.prompts": PROMPTS[:1],
            "validation.num_inference_steps": 2,
            "checkpoint.checkpointing_steps": 3,
        },
    )
    # the cache complete: what follows loads encoders for validation only
    cache.main(["--cfg", str(config)])
    loads = {"vae": 0, "t5": 0}

    def counting(name, original):
        def load(*args, **kwargs):
            loads[name] += 1
            return original(*args, **kwargs)

        return load

    monkeypatch.setattr(
        AutoencoderKLCogVideoX, "from_pretrained", counting("vae", AutoencoderKLCogVideoX.from_pretrained)
    )
    monkeypatch.setattr(T5EncoderModel, "from_pretrained", counting("t5", T5EncoderModel.from_pretrained))
    trainer.main(["--cfg", str(config)])
    assert validation_steps(tmp_path / "loads") == [0, 1, 2, 3] and loads == {"vae": 1, "t5": 1}


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return load_adapter(ModelConfig(path=str(tiny_model), dtype="fp32"), torch.device("cpu"))


def pipeline_frames(tiny_model, adapter, cfg: ValidationConfig, lora_file=None) -> list[torch.Tensor]:
    """CogVideoXPipeline called once per prompt with clip i's keyed generator: float frames [F, H,
    W, 3]."""
    pipe = CogVideoXPipeline.from_pretrained(str(tiny_model))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = adapter.sampler(cfg.scheduler)
    if lora_file:
        pipe.load_lora_weights(str(lora_file))
    return [
        pipe(
            prompt,
            num_frames=9,
            height=32,
            width=32,
            num_inference_steps=cfg.num_inference_steps,
            guidance_scale=cfg.guidance_scale,
            use_dynamic_cfg=cfg.use_dynamic_cfg,
            generator=data.keyed_generator(cfg.seed, i),
            output_type="pt",
            max_sequence_length=adapter.text_length,
        )
        .frames[0]
        .permute(0, 2, 3, 1)
        for i, prompt in enumerate(cfg.prompts)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("scheduler,dynamic", [("dpm", True), ("ddim", False)])
def test_frames_equal_pipeline(
    runs, tiny_model, tiny_data, adapter, one_process_group, tmp_path, scheduler, dynamic
):
    """Our loop gives the pipeline's frames, with the base model and with our LoRA.

    Our loop (fused attention, keyed noise, batched CFG) gives the pipeline's frames, with the base
    model and with the trained LoRA loaded into the pipeline from our export."""
    cfg = ValidationConfig(
        prompts=PROMPTS[:2], num_inference_steps=12, scheduler=scheduler, use_dynamic_cfg=dynamic
    )
    settings = {
        "run.output_dir": str(tmp_path),
        "model.path": str(tiny_model),
        "model.dtype": "fp32",
        "data.data_root": str(tiny_data),
        "data.train_resolution": [9, 32, 32],
        "train.mixed_precision": "no",
        "lora.rank": 4,
        "lora.lora_alpha": 2,
    }
    run_cfg = load_config(str(write_toml(tmp_path / "c.toml", settings)))
    renderer = validate.ClipRenderer(adapter, cfg, run_cfg.data, str(tmp_path), one_process_group)
    lora_file = runs / "one" / "lora" / "pytorch_lora_weights.safetensors"
    results = {}
    for source in (None, lora_file):
        model = render.load_model(run_cfg, adapter, one_process_group, None, source)
        with adapter.sampling_attention(model):
            ours = [
                renderer.frames(model, i, adapter.sampler(scheduler), contextlib.nullcontext())
                for i in range(len(cfg.prompts))
            ]
        theirs = pipeline_frames(tiny_model, adapter, cfg, source)
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape == (9, 32, 32, 3)
            assert (a - b).abs().max() <= 1e-4
        results[source] = ours
    # the LoRA shows in the frames
    assert (results[None][0] - results[lora_file][0]).abs().max() > 1e-2


@pytest.mark.slow
def test_fused_attention_and_render_leave_the_model_alone(
    runs, tiny_model, adapter, one_process_group, tmp_path
):
    """Fused attention matches diffusers', and rendering leaves the model as it was.

    The fused processor matches diffusers' on a LoRA model; rendering restores the processors and
    train mode, and leaves every weight bitwise unchanged."""
    transformer = adapter.load_transformer()
    weights, info = lora.load_lora(str(runs / "one" / "lora" / "pytorch_lora_weights.safetensors"))
    lora.inject_lora(transformer, info["target_modules"], info["rank"], info["alpha"], 0.0, 0)
    lora.load_lora_into(transformer, weights)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, 8, generator=gen)
    text = torch.randn(2, adapter.text_length, 32, generator=gen)
    rotary = adapter.rotary_embeddings(3, 8, 8)
    with torch.no_grad():
        expected = adapter.predict_v(transformer, x, torch.tensor([10, 900]), text, rotary)
        with adapter.sampling_attention(transformer):
            fused = adapter.predict_v(transformer, x, torch.tensor([10, 900]), text, rotary)
    torch.testing.assert_close(fused, expected, rtol=0, atol=1e-5)

    processors = {name: m.processor for name, m in transformer.named_modules() if hasattr(m, "processor")}
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    transformer.train()
    cfg = ValidationConfig(prompts=PROMPTS[:1], num_inference_steps=2)
    renderer = validate.ClipRenderer(
        adapter,
        cfg,
        load_config(
            None,
            [
                "--run.output_dir",
                str(tmp_path),
                "--model.path",
                str(tiny_model),
                "--data.data_root",
                str(tmp_path),
                "--data.train_resolution",
                "[9, 32, 32]",
            ],
        ).data,
        str(tmp_path),
        one_process_group,
    )
    (clip,) = renderer.render(transformer, contextlib.nullcontext())
    assert clip.dtype == torch.uint8 and clip.shape == (9, 32, 32, 3)
    assert all(m.training for m in transformer.modules())
    assert {
        name: m.processor for name, m in transformer.named_modules() if hasattr(m, "processor")
    } == processors
    assert all(torch.equal(before[k], v) for k, v in transformer.state_dict().items())


def test_fused_attention_applies_lora_as_training_does(tiny_model):
    """Fused attention applies a young LoRA as training does, bitwise.

    bf16 weights with a young LoRA (small B): merging it into a bf16 copy of the weights would round
    its deltas differently from training's forward; the fused processor applies it unmerged and
    gives training's output bitwise."""
    adapter = load_adapter(ModelConfig(path=str(tiny_model), dtype="bf16"), torch.device("cpu"))
    transformer = adapter.load_transformer().eval()
    lora.inject_lora(transformer, ["to_q", "to_k", "to_v", "to_out.0"], 4, 2, 0.0, 0)
    gen = torch.Generator().manual_seed(0)
    x, text = (
        torch.randn(2, 3, 4, 8, 8, generator=gen),
        torch.randn(2, adapter.text_length, 32, generator=gen),
    )
    rotary = adapter.rotary_embeddings(3, 8, 8)

    def outputs():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            training = adapter.predict_v(transformer, x, torch.tensor([10, 900]), text, rotary)
            with adapter.sampling_attention(transformer):
                return training, adapter.predict_v(transformer, x, torch.tensor([10, 900]), text, rotary)

    base, _ = outputs()
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-4)
    training, fused = outputs()
    assert not torch.equal(training, base)
    assert torch.equal(fused, training)


def test_config_errors(tiny_model, adapter, one_process_group, tmp_path):
    required = [
        "--run.output_dir",
        str(tmp_path),
        "--model.path",
        str(tiny_model),
        "--data.data_root",
        str(tmp_path),
    ]
    with pytest.raises(ConfigError, match=r"validation.resolution must be \[\] or"):
        load_config(None, [*required, "--validation.resolution", "[9, 32]"])
    with pytest.raises(ConfigError, match="validation.num_inference_steps must be at least 1"):
        load_config(None, [*required, "--validation.num_inference_steps", "0"])
    i2v = [*required, "--model.type", "i2v", "--validation.prompts", '["a ball"]']
    with pytest.raises(ConfigError, match="validation.images has 0 for 1 validation.prompts"):
        load_config(None, i2v)
    # no clips in training: no images needed
    off = load_config(None, [*i2v, "--validation.do_validation", "false"])
    # but to render
    with pytest.raises(ConfigError, match="validation.images has 0 for 1 validation.prompts"):
        render.render_command(off, [], [], None, None, False, one_process_group)
    with pytest.raises(
        ConfigError, match=r"validation.gen_fps must be 0 \(the family's published rate\) or positive"
    ):
        load_config(None, [*required, "--validation.gen_fps", "-1"])
    with pytest.raises(ConfigError, match="validation.scheduler"):
        load_config(None, [*required, "--validation.scheduler", "euler"])
    cfg = load_config(None, [*required, "--validation.resolution", "[8, 32, 32]"])
    with pytest.raises(ConfigError, match="validation.resolution frames = 8"):
        validate.ClipRenderer(adapter, cfg.validation, cfg.data, str(tmp_path), one_process_group)


def test_gen_fps_zero_is_the_familys_published_rate(tiny_models, wan_models, one_process_group, tmp_path):
    """validation.gen_fps = 0 is the family's published rate.

    validation.gen_fps = 0 (every shipped config but the demo) writes clips at the family's
    published rate, a set value wins; validation.guidance_scale_2 without a second expert is refused
    before any compute."""
    clip = torch.zeros(9, 32, 32, 3, dtype=torch.uint8)
    for family, path, published in [
        ("cogvideox", tiny_models("2b"), 8),
        ("cogvideox", tiny_models("1.5-5b"), 16),
        ("wan", wan_models("t2v"), 16),
        ("wan", wan_models("ti2v-5b"), 24),
    ]:
        adapter = load_adapter(ModelConfig(family=family, path=str(path)), torch.device("cpu"))
        for gen_fps, expected in ((0, published), (FPS, FPS)):
            cfg = ValidationConfig(gen_fps=gen_fps, resolution=[9, 32, 32])
            renderer = validate.ClipRenderer(
                adapter, cfg, DataConfig(), str(tmp_path / f"{path.name}_{gen_fps}"), one_process_group
            )
            assert decode_mp4(renderer.save([clip], ["step_1_prompt_0"])[0])[1] == expected, (
                path.name,
                gen_fps,
            )
        with pytest.raises(
            ConfigError, match="validation.guidance_scale_2 guides Wan 2.2 A14B's low-noise expert"
        ):
            validate.ClipRenderer(
                adapter,
                ValidationConfig(guidance_scale_2=3.0, resolution=[9, 32, 32]),
                DataConfig(),
                str(tmp_path),
                one_process_group,
            )


@pytest.mark.slow
def test_render_command_errors(runs):
    """The render command's errors: exit 1 with the fix in the message.

    No prompt, or a config that does not describe the checkpoint: exit 1 with the fix in the
    message; a stop signal during the render: exit 1."""
    out = runs / "one"
    no_prompt = run_cmd(["--cfg", str(runs / "plain.toml"), "--validation.prompts", "[]"], script="render.py")
    assert (
        no_prompt.returncode == 1
        and "nothing to render: pass --prompt" in no_prompt.stderr + no_prompt.stdout
    )
    wrong = run_cmd(
        [
            "--cfg",
            str(runs / "one.toml"),
            "--checkpoint",
            str(out / "checkpoint-4"),
            "--prompt",
            "a",
            "--lora.rank",
            "8",
        ],
        script="render.py",
    )
    assert (
        wrong.returncode == 1
        and "was trained with lora = {" in wrong.stderr
        and "(the run's config.toml)" in wrong.stderr
    )
    # Stopped by a signal, it has written nothing for a relaunch to continue: not a success.
    stopped = run_cmd(
        ["--cfg", str(runs / "one.toml"), "--prompt", "a", "--validation.num_inference_steps", "2"],
        script="render.py",
        env={"VIDTRAIN_FAULT": "render_sigterm:2"},
    )
    assert stopped.returncode == 1 and "stopped by a signal before the clips were written" in stopped.stderr


def test_clips_come_from_data_parallel_leaders_only(monkeypatch):
    """With sequence parallelism rank 0 collects each clip from its group's first rank only.

    With sequence parallelism every rank of an sp group renders the same clip: rank 0 receives it
    from the group's first rank only, in data-parallel order, and the other ranks send nothing
    (their copies would multiply the traffic by parallel.sp_size). 6 ranks as 3 sp groups of 2, each
    rank's collection run in turn (ClipRenderer._collect, what render calls), with the sends
    recorded and handed to rank 0's receives."""
    world, sp = 6, 2
    clips = {rank: torch.full((1, 2, 2, 3), rank, dtype=torch.uint8) for rank in range(world)}
    sent, received = {}, []
    monkeypatch.setattr(
        dist, "send", lambda tensor, dst: sent.setdefault(rank, []).append((dst, tensor.clone()))
    )

    def recv(tensor, src):
        received.append(src)
        tensor.copy_(sent[src].pop(0)[1])

    monkeypatch.setattr(dist, "recv", recv)
    renderer = object.__new__(validate.ClipRenderer)
    gathered = {}
    for rank in [*range(1, world), 0]:
        renderer.d = ranks.Dist(rank, world, rank, torch.device("cpu"), sp)
        gathered[rank] = renderer._collect(clips[rank])
    assert sorted(sent) == [2, 4], "the ranks that sent their clip"
    assert received == [2, 4] and all(not unreceived for unreceived in sent.values())
    assert [int(clip.max()) for clip in gathered[0]] == [0, 2, 4]
    assert all(gathered[rank] == [] for rank in range(1, world))
