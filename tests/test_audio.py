"""A clip's sound: read, cut to its frames' seconds, mixed, resampled and turned into log-mel.

Read with PyAV from any container, cut to the seconds its planned frames cover, mixed, resampled and
turned into the log-mel spectrogram LTX-2's audio VAE encodes.

The window tests write clips whose picture and sound switch on and off together, frame by frame, in
an irregular pattern: any shift of the sound against the frames, or a window of another length,
shows."""

import dataclasses
import logging
import shutil
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from conftest import one_rank_group, prepare_run, write_toml
from diffusers import AutoencoderKLLTX2Audio
from safetensors.torch import load_file
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

import data
import decode
from config import DataConfig, load_config
from families.cogvideox import CogVideoXAdapter
from tools.make_synthetic_dataset import make_synthetic_dataset, write_clip, write_sound

FPS, RATE = 8, 16000
# On or off per pair of frames (so a 4 fps window sees whole pairs): no shift of it matches itself.
PATTERN = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0]
CONTAINERS = {
    "mp4": ("mp4", "aac", 44100),
    "mkv": ("matroska", "libopus", 48000),
    "mka": ("matroska", "aac", 44100),
    "ts": ("mpegts", "mp2", 44100),
    "m2ts": ("mpegts", "aac", 48000),
}
LAYOUTS = {1: "mono", 2: "stereo", 8: "7.1"}
SUFFIXES = {"mp4": "mp4", "matroska": "mkv", "mpegts": "ts"}


def write_flashes(
    path: Path,
    kind: str,
    video_start: float = 0.0,
    channels: int = 2,
    early_noise: bool = False,
    steady: bool = False,
) -> None:
    """40 frames at 8 fps, frame k white while PATTERN[k // 2] (else black; `steady`: always white),
    and a 440 Hz tone exactly while a white frame is shown. The video's first frame is shown at
    `video_start` seconds on the container's clock, the sound starts at 0 (`early_noise`: loud noise
    before the first frame)."""
    form, codec, rate = CONTAINERS[kind]
    bits = np.repeat([1] * len(PATTERN) if steady else PATTERN, 2)
    t = np.arange(round((video_start + len(bits) / FPS) * rate)) / rate
    frame_of = np.floor((t - video_start) * FPS).astype(int)
    shown = (frame_of >= 0) & (bits[frame_of.clip(0, len(bits) - 1)] == 1)
    sound = np.where(shown, 0.3 * np.sin(2 * np.pi * 440 * t), 0.0)
    if early_noise:
        sound = np.where(frame_of < 0, np.random.default_rng(0).uniform(-0.5, 0.5, len(t)), sound)
    with av.open(str(path), "w", format=form) as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt, stream.codec_context.time_base = "yuv420p", Fraction(1, 1000)
        audio = container.add_stream(codec, rate=rate, layout=LAYOUTS[channels])
        for k, bit in enumerate(bits):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 255 * bit, np.uint8), format="rgb24")
            frame.pts, frame.time_base = round(1000 * (video_start + k / FPS)), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        write_sound(container, audio, np.repeat(sound[None].astype(np.float32), channels, 0))


def planned(path: Path, frames: int, target_fps: float = 0.0, seed: int = 0) -> data.Item:
    cfg = DataConfig(data_root=str(path.parent), train_resolution=[frames, 32, 32], target_fps=target_fps)
    item = data.plan_clip(
        data.Clip(path, "flashes", 1, "videos.txt"),
        decode.probe(path),
        f"{path}",
        [(frames, 32, 32)],
        cfg,
        seed,
    )
    assert isinstance(item, data.Item), item
    return item


def assert_in_step(item: data.Item) -> None:
    """The window's sound is loud in each frame's seconds exactly when that frame is white, and
    lasts as long as the frames."""
    frames, rate = item.resolution[0], item.rate
    video = data.decode_clip(item)
    sound = data.decode_audio(item, RATE, 2)
    assert sound.shape == (2, round(frames / rate * RATE))
    white = [bool(v > 128) for v in video.float().mean(dim=(1, 2, 3))]
    # away from each slot's edges: codecs smear a switch over ms
    slot, edge = RATE / rate, round(0.02 * RATE)
    loud = [
        bool(sound[:, round(j * slot) + edge : round((j + 1) * slot) - edge].pow(2).mean().sqrt() > 0.05)
        for j in range(frames)
    ]
    assert loud == white, f"start {item.start} at {rate} fps"
    assert any(white) and not all(white)


@pytest.mark.parametrize("kind", ["mp4", "mkv"])
def test_sound_covers_exactly_the_planned_frames(tmp_path, kind):
    """The sound of the planned window matches its frames, in AAC/mp4 and Opus/Matroska.

    AAC in mp4 and Opus in Matroska: the sound of the window the plan picks (a clip longer than its
    bucket, so the start is drawn), of other starts, and at another frame rate, matches its frames.
    """
    path = tmp_path / f"flashes.{kind}"
    write_flashes(path, kind)
    item = planned(path, 17)
    for start in {item.start, 0, 5, 23}:
        assert_in_step(dataclasses.replace(item, start=start))
    slower = planned(path, 9, target_fps=4)
    for start in (0, 3, 11):
        assert_in_step(dataclasses.replace(slower, start=start))


def test_sound_follows_the_first_frame_not_the_stream_start(tmp_path):
    """The sound window is timed from the first frame, not from the audio stream's start.

    A video stream that starts 0.5 s after its audio (noise until then, mono): the window is timed
    from the first frame, on both streams' clock."""
    path = tmp_path / "late.mkv"
    write_flashes(path, "mkv", video_start=0.5, channels=1, early_noise=True)
    item = planned(path, 17)
    for start in (0, 2, 9):
        assert_in_step(dataclasses.replace(item, start=start))


def test_frames_stamped_in_milliseconds_join_without_gaps(tmp_path):
    """AAC in Matroska: 1024-sample frames (23.2 ms) stamped in whole milliseconds.

    Placed by their stamps alone they would overlap or leave gaps, a click every frame; a steady
    tone decodes clean, nothing above 2 kHz."""
    path = tmp_path / "steady.mkv"
    write_flashes(path, "mka", steady=True)
    sound = data.decode_audio(planned(path, 17), RATE, 2)
    spectrum = torch.stft(sound[0], 1024, 160, window=torch.hann_window(1024), return_complex=True).abs()
    # bins from 2 kHz up; clicks put 1e-3 there
    assert spectrum[128:].mean() < 1e-4 * spectrum.max()


def test_no_sound(tmp_path):
    """A video without an audio stream, and an image, have no sound.

    A video without an audio stream and an image have no sound (not silence); data.audio is the
    caller's switch."""
    make_synthetic_dataset(str(tmp_path), num_videos=1, frames=9)
    video = decode.probe(tmp_path / "videos/00000.mp4")
    item = planned(tmp_path / "videos/00000.mp4", 9)
    assert video.frames == 9 and data.decode_audio(item, RATE, 2) is None
    image = planned(tmp_path / "images/00000.png", 1)
    assert data.decode_audio(image, RATE, 2) is None


def write_garbage_sound(path: Path) -> None:
    """16 black frames and an AAC stream of random bytes."""
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=44100, layout="stereo")
        for _ in range(16):
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24"))
            )
        container.mux(stream.encode())
        noise = np.random.default_rng(0)
        for k in range(40):
            packet = av.Packet(noise.integers(0, 256, 300, dtype=np.uint8).tobytes())
            packet.stream, packet.pts, packet.dts, packet.duration = audio, k * 1024, k * 1024, 1024
            packet.time_base = Fraction(1, 44100)
            container.mux(packet)


def test_undecodable_sound_is_a_bad_clip(tmp_path):
    """An AAC stream of garbage: the clip is bad input with the reason, its frames still decode."""
    path = tmp_path / "garbage.mp4"
    write_garbage_sound(path)
    item = planned(path, 9)
    assert data.decode_clip(item).shape == (9, 32, 32, 3)
    with pytest.raises(data.BadClip, match="cannot decode its audio stream"):
        data.decode_audio(item, RATE, 2)


def write_tone(path: Path, form: str, codec: str, channels: int, frames: int = 9, levels=None) -> None:
    """`frames` grey frames at 8 fps and as long a 440 Hz tone at 48 kHz, of amplitude 0.3 on every
    channel (or channel k's levels[k])."""
    with av.open(str(path), "w", format=form) as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream(codec, rate=48000, layout=LAYOUTS[channels])
        grey = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 128, np.uint8), format="rgb24")
        for _ in range(frames):
            container.mux(stream.encode(grey))
        container.mux(stream.encode())
        tone = np.sin(2 * np.pi * 440 * np.arange(frames * 48000 // FPS) / 48000)
        levels = np.full(channels, 0.3) if levels is None else np.asarray(levels)
        write_sound(container, audio, (levels[:, None] * tone[None]).astype(np.float32))


# Codecs in containers that users' clips carry: 7.1 in mp4 and Matroska (PyAV 18.1 segfaulted
# reading planar 8-channel frames); lossless codecs in Matroska and MP2 in MPEG-TS, whose timestamps
# do not count samples.
SOUNDS = [
    ("mp4", "aac", 8),
    ("mp4", "flac", 8),
    ("mp4", "pcm_s16le", 8),
    ("matroska", "aac", 8),
    ("matroska", "flac", 8),
    ("matroska", "pcm_s16le", 8),
    ("matroska", "flac", 2),
    ("matroska", "pcm_s16le", 2),
    ("matroska", "alac", 2),
    ("mpegts", "mp2", 2),
]


@pytest.mark.parametrize("form, codec, channels", SOUNDS, ids=[f"{c}-{n}ch-{f}" for f, c, n in SOUNDS])
def test_a_steady_tone_sounds_in_every_slot(tmp_path, form, codec, channels):
    """A steady tone sounds in every frame's slot at its level, from each codec and container.

    A steady tone on every channel: the first second's sound holds it in every frame's slot, at its
    level (7.1 folds to stereo with weights summing to 1), from each codec in each container."""
    path = tmp_path / f"tone.{SUFFIXES[form]}"
    write_tone(path, form, codec, channels)
    waveform = data.read_audio(path, decode.probe(path), 0.0, 1.0, RATE, 2)
    slot, edge = RATE // FPS, round(0.02 * RATE)
    levels = [
        float(waveform[:, j * slot + edge : (j + 1) * slot - edge].pow(2).mean().sqrt()) for j in range(FPS)
    ]
    assert levels == pytest.approx([0.3 / 2**0.5] * FPS, rel=0.05)


def test_surround_folds_each_side_from_its_own_channels(tmp_path):
    """7.1 folds to stereo with each side from its own channels.

    PCM 7.1 in Matroska, each channel the tone at its own level, in FFmpeg's order (front L, R,
    centre, LFE, back L, R, side L, R): each side of the fold is its front plus 0.707 x (the centre
    and its two surrounds), over 3.121, the LFE dropped. The packed samples come apart into their
    channels."""
    path = tmp_path / "surround.mkv"
    levels = 0.02 * np.arange(1, 9)
    write_tone(path, "matroska", "pcm_s16le", 8, levels=levels)
    waveform = data.read_audio(path, decode.probe(path), 0.0, 1.0, RATE, 2)
    amplitude = waveform[:, 1000:-1000].pow(2).mean(1).sqrt() * 2**0.5
    expected = [
        (levels[front] + 0.707 * levels[[2, *surrounds]].sum()) / 3.121
        for front, surrounds in ((0, [4, 6]), (1, [5, 7]))
    ]
    torch.testing.assert_close(amplitude, torch.tensor(expected, dtype=torch.float32), rtol=0.01, atol=0)


@pytest.mark.parametrize("kind", ["ts", "m2ts"])
def test_transport_streams_decode_in_step(tmp_path, kind):
    """MPEG-TS windows decode in step with their frames, though the format has no index.

    MPEG-TS (.ts with MP2, .m2ts with AAC) has no index: a seek can land past the window's start, or
    find nothing. The frames and the sound of windows at the start, the middle and the end match."""
    path = tmp_path / f"flashes.{kind}"
    write_flashes(path, kind)
    item = planned(path, 17)
    for start in {item.start, 0, 11, 23}:
        assert_in_step(dataclasses.replace(item, start=start))


def test_a_crashing_decoder_names_the_clip(tmp_path, monkeypatch):
    """A crashing sound decoder makes its clip bad input, named with the signal.

    The child decoding a clip's sound dies of SIGSEGV (the sound_segv fault, as PyAV 18.1 did on
    7.1): the clip is bad input naming the signal, and the next clip decodes in a new child."""
    path = tmp_path / "tone.mkv"
    write_tone(path, "matroska", "flac", 2)
    item = planned(path, 9)
    monkeypatch.setenv("VIDTRAIN_FAULT", f"sound_segv:{data._sounds + 1}")
    with pytest.raises(data.BadClip, match=r"^crashed the audio decoder \(SIGSEGV\), a bug in FFmpeg or "):
        data.decode_audio(item, RATE, 2)
    assert data.decode_audio(item, RATE, 2).abs().max() > 0.2


def test_a_corrupt_stream_far_past_full_scale_is_a_bad_clip(tmp_path):
    """A corrupt stream decoding far past full scale is a bad clip.

    Opus packets of random bytes decode to samples in the hundreds: the clip is bad input, not
    trained on."""
    path = tmp_path / "corrupt.mkv"
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream("libopus", rate=48000, layout="stereo")
        black = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for _ in range(9):
            container.mux(stream.encode(black))
        container.mux(stream.encode())
        noise = np.random.default_rng(1)  # seeds differ: this one peaks at 258
        for k in range(60):
            packet = av.Packet(noise.integers(0, 256, 200, dtype=np.uint8).tobytes())
            packet.stream, packet.pts, packet.dts, packet.duration = audio, k * 960, k * 960, 960
            packet.time_base = Fraction(1, 48000)
            container.mux(packet)
    with pytest.raises(data.BadClip, match=r"^its sound decodes to samples up to \d+, far outside \[-1, 1\]"):
        data.decode_audio(planned(path, 9), RATE, 2)


def test_rates_without_a_common_factor_resample_pointwise():
    """Rates without a common factor resample pointwise, with the kernels' filter.

    44,101 Hz has no factor in common with 16 kHz: its 16,000 phase kernels would take 5.6 GB, so
    each output's weights are computed where needed. The same filter as the kernels' (44.1 kHz both
    ways), and a 1 kHz sine at 44,101 Hz comes out as that sine at 16 kHz."""
    noise = torch.randn(2, 44100)
    pointwise = data._resample_pointwise(noise, 441, 160, RATE)
    torch.testing.assert_close(pointwise, data.resample(noise, 44100, RATE), rtol=0, atol=1e-5)
    sine = torch.sin(2 * torch.pi * 1000 * torch.arange(44101, dtype=torch.float64) / 44101)[None].float()
    expected = torch.sin(2 * torch.pi * 1000 * torch.arange(RATE) / RATE)[None]
    out = data.resample(sine, 44101, RATE)
    assert out.shape == (1, RATE)
    torch.testing.assert_close(out[:, 100:-100], expected[:, 100:-100], rtol=0, atol=2e-3)


def test_mel_equals_the_reference():
    """Our log-mel equals transformers' implementation of LTX-2's transform.

    Our log-mel against transformers' numpy implementation of the same transform (torchaudio's
    MelSpectrogram with the settings of LTX-2's audio processor: magnitude STFT, periodic Hann,
    centred with reflection, Slaney mel scale and norm, log floored at 1e-5), on a sweep with
    silence in it and on noise: equal in float64; float32 (what training uses) within its rounding
    near the floor."""
    t = torch.arange(RATE, dtype=torch.float64) / RATE
    waveform = torch.stack(
        [0.4 * torch.sin(2 * torch.pi * (100 + 3000 * t) * t), 0.2 * torch.randn(RATE).double()]
    )
    waveform[:, 4000:6000] = 0
    exact, rounded = (
        data.log_mel(waveform, RATE, 1024, 160, 64),
        data.log_mel(waveform.float(), RATE, 1024, 160, 64),
    )
    assert exact.shape == rounded.shape == (2, RATE // 160 + 1, 64) and rounded.dtype == torch.float32
    filters = mel_filter_bank(
        num_frequency_bins=513,
        num_mel_filters=64,
        min_frequency=0.0,
        max_frequency=RATE / 2,
        sampling_rate=RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    for channel in range(2):
        reference = torch.from_numpy(
            spectrogram(
                waveform[channel].numpy(),
                window_function(1024, "hann", periodic=True),
                1024,
                160,
                power=1.0,
                center=True,
                pad_mode="reflect",
                mel_filters=filters,
                mel_floor=1e-5,
                log_mel="log",
                dtype=np.float64,
            ).T
        )
        torch.testing.assert_close(exact[channel], reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(rounded[channel], reference.float(), rtol=0, atol=1e-2)


def test_resampling_keeps_time_and_pitch():
    """Resampling to 16 kHz keeps a sine's time, pitch and level.

    A 1 kHz sine at 44.1 and 48 kHz, resampled to 16 kHz, is the same sine sampled at 16 kHz: no
    delay, no change of pitch or level (away from the ends, where the signal stops)."""
    for rate in (44100, 48000, 8000):
        sine = torch.sin(2 * torch.pi * 1000 * torch.arange(rate) / rate)[None].double()
        out = data.resample(sine.float(), rate, RATE)
        expected = torch.sin(2 * torch.pi * 1000 * torch.arange(RATE) / RATE)[None]
        assert out.shape == (1, RATE)
        torch.testing.assert_close(
            out[:, 100:-100], expected[:, 100:-100], rtol=0, atol=2e-3 if rate > RATE else 1e-2
        )


def test_channels_mix_as_the_official_trainer_does():
    """Channels mix to stereo as the official trainer mixes them.

    Mono is copied to both sides; 5.1 keeps each side's front and adds the centre and that side's
    surround at 0.707, the LFE dropped, weights summing to 1; two channels to one average."""
    mono = torch.tensor([[1.0, -2.0]])
    assert data.mix(mono, 2).tolist() == [[1.0, -2.0], [1.0, -2.0]]
    surround = torch.eye(6)  # one sample per channel: the columns are each channel's weights
    left, right = data.mix(surround, 2)
    torch.testing.assert_close(left, torch.tensor([1, 0, 0.707, 0, 0.707, 0]) / 2.414)
    torch.testing.assert_close(right, torch.tensor([0, 1, 0.707, 0, 0, 0.707]) / 2.414)
    assert data.mix(torch.tensor([[1.0], [3.0]]), 1).tolist() == [[2.0]]


class Sounding(CogVideoXAdapter):
    """The tiny CogVideoX with an audio VAE beside it: what the cache needs of a family with sound
    (LTX-2's adapter provides the same members; AUDIO_DTYPE, the audio VAE's, keys the audio
    entries)."""

    ENCODERS = {**CogVideoXAdapter.ENCODERS, "audio": ("audio_vae",)}
    AUDIO_DTYPE = "fp32"  # encode_audio runs the VAE as from_pretrained loads it
    audio_sample_rate, audio_channels = RATE, 2

    def encode_audio(self, waveforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae = AutoencoderKLLTX2Audio.from_pretrained(self.path / "audio_vae")
        posterior = vae.encode(data.log_mel(waveforms[0], RATE, 1024, 160, 64)[None]).latent_dist
        return posterior.mean, posterior.logvar


def sounding_model(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny CogVideoX with a tiny audio VAE beside it (what Sounding loads)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    AutoencoderKLLTX2Audio(
        base_channels=8, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4
    ).save_pretrained(model / "audio_vae")
    return model


def test_the_cache_holds_each_windows_sound(tiny_model, tmp_path, monkeypatch, caplog):
    """The cache pass holds each clip's window of sound through the audio VAE.

    The cache pass of a family with sound: each clip's audio entry is its window's sound through the
    audio VAE, keyed by the window; a clip without sound gets an empty entry (a batch holding it
    trains video alone); an undecodable audio stream is a bad clip, skipped and listed under
    data.skip_bad; data.audio = false writes no audio entries."""
    model = sounding_model(tiny_model, tmp_path)
    root = tmp_path / "data"
    (root / "videos").mkdir(parents=True)
    write_flashes(root / "videos/flashes.mp4", "mp4")
    write_clip(root / "videos/silent.mp4", np.zeros((16, 32, 32, 3), np.uint8), FPS)
    write_garbage_sound(root / "videos/garbage.mp4")
    (root / "prompts.txt").write_text("flashes\nsilent\ngarbage\n")
    (root / "videos.txt").write_text("videos/flashes.mp4\nvideos/silent.mp4\nvideos/garbage.mp4\n")
    monkeypatch.setattr("model.load_adapter", Sounding)  # the adapter model.setup_adapter builds
    settings = {
        "run.output_dir": str(tmp_path / "run"),
        "model.path": str(model),
        "model.dtype": "fp32",
        "data.data_root": str(root),
        "data.train_resolution": [9, 32, 32],
        "data.skip_bad": True,
    }
    for audio in (False, True):
        cfg = load_config(str(write_toml(tmp_path / "run.toml", {**settings, "data.audio": audio})))
        with one_rank_group() as d, caplog.at_level(logging.INFO, logger="vidtrain"):
            adapter, entries, items, _ = prepare_run(cfg, d)
        assert [item.clip.video.name for item in items] == ["flashes.mp4", "silent.mp4", "garbage.mp4"][
            : 3 - audio
        ]
        assert ("audio" in entries.kinds) == audio
    # The second pass added the sound alone: the video entries were complete, the video VAE stayed
    # unloaded.
    assert caplog.text.count("loading VAE") == 1 and "2 clips encoded, 0 reused, 1 skipped" in caplog.text
    assert (
        (tmp_path / "run/skipped.txt")
        .read_text()
        .startswith(f"{root / 'videos/garbage.mp4'}\tcannot decode its audio stream")
    )
    flashes, silent = items
    assert flashes.start > 0  # a window inside a longer clip
    cached = load_file(entries.path(flashes, "audio"))
    mean, logvar = adapter.encode_audio(data.decode_audio(flashes, RATE, 2)[None])
    # 9 frames at 8 fps: 18,000 samples, 113 mel frames; the tiny VAE's one downsampling halves time
    # and mel bins.
    assert cached["audio_latent_mean"].shape == (4, 57, 32)
    torch.testing.assert_close(cached["audio_latent_mean"], mean[0])
    torch.testing.assert_close(cached["audio_latent_logvar"], logvar[0])
    other = dataclasses.replace(flashes, start=flashes.start - 1)
    assert entries.path(other, "audio") != entries.path(flashes, "audio")
    assert load_file(entries.path(silent, "audio")) == {}
    assert "audio_latent_mean" in entries.load_batch([flashes, flashes])
    # zeros for the silent clip's sound, which the mask leaves out
    mixed = entries.load_batch([flashes, silent])
    assert mixed["audio_mask"].tolist() == [True, False] and not mixed["audio_latent_mean"][1].any()
    assert "audio_mask" not in entries.load_batch([flashes, flashes])


def test_the_cache_pass_names_a_crashed_decoder_and_says_when_nothing_sounds(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """The cache pass skips a clip whose sound decoder crashes, and says when nothing sounds.

    A 7.1 soundtrack (AAC in mp4) is encoded; a clip whose sound decoder crashes (the sound_segv
    fault on the second clip read, one decode worker) is skipped and listed with the signal, and the
    pass goes on. A run none of whose clips has sound says so, once."""
    model = sounding_model(tiny_model, tmp_path)
    root = tmp_path / "data"
    (root / "videos").mkdir(parents=True)
    write_tone(root / "videos/surround.mp4", "mp4", "aac", 8)
    write_tone(root / "videos/crash.mp4", "mp4", "aac", 2)
    write_clip(root / "videos/silent.mp4", np.zeros((9, 32, 32, 3), np.uint8), FPS)
    (root / "prompts.txt").write_text("surround\ncrash\nsilent\n")
    (root / "videos.txt").write_text("videos/surround.mp4\nvideos/crash.mp4\nvideos/silent.mp4\n")
    monkeypatch.setattr("model.load_adapter", Sounding)  # the adapter model.setup_adapter builds
    monkeypatch.setenv("VIDTRAIN_FAULT", f"sound_segv:{data._sounds + 2}")
    settings = {
        "run.output_dir": str(tmp_path / "run"),
        "model.path": str(model),
        "model.dtype": "fp32",
        "data.data_root": str(root),
        "data.train_resolution": [9, 32, 32],
        "data.skip_bad": True,
        "data.audio": True,
        "data.decode_workers": 1,
    }
    with one_rank_group() as d, caplog.at_level(logging.INFO, logger="vidtrain"):
        _, entries, items, _ = prepare_run(load_config(str(write_toml(tmp_path / "run.toml", settings))), d)
        assert [item.clip.video.name for item in items] == ["surround.mp4", "silent.mp4"]
        assert (
            (tmp_path / "run/skipped.txt")
            .read_text()
            .startswith(f"{root / 'videos/crash.mp4'}\tcrashed the audio decoder (SIGSEGV)")
        )
        assert "audio_latent_mean" in load_file(entries.path(items[0], "audio"))
        assert "has an audio stream" not in caplog.text
        (root / "videos.txt").write_text("videos/silent.mp4\n")
        (root / "prompts.txt").write_text("silent\n")
        prepare_run(
            load_config(
                str(
                    write_toml(tmp_path / "run.toml", {**settings, "data.cache_dir": str(tmp_path / "other")})
                )
            ),
            d,
        )
    assert (
        caplog.text.count(
            "data.audio is on, but none of the 1 clip(s) whose sound this pass read has an audio stream"
        )
        == 1
    )
