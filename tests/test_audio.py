"""A clip's sound: read with PyAV from any container, cut to the seconds its planned frames cover, mixed,
resampled and turned into the log-mel spectrogram LTX-2's audio VAE encodes.

The window tests write clips whose picture and sound switch on and off together, frame by frame, in
an irregular pattern: any shift of the sound against the frames, or a window of another length, shows.
"""

import dataclasses
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

import data
import decode
from config import DataConfig
from tools.make_synthetic_dataset import make_synthetic_dataset, write_sound

FPS, RATE = 8, 16000
# On or off per pair of frames (so a 4 fps window sees whole pairs): no shift of it matches itself.
PATTERN = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0]
CONTAINERS = {"mp4": ("mp4", "aac", 44100), "mkv": ("matroska", "libopus", 48000), "mka": ("matroska", "aac", 44100)}


def write_flashes(path: Path, kind: str, video_start: float = 0.0, channels: int = 2, early_noise: bool = False,
                  steady: bool = False) -> None:
    """40 frames at 8 fps, frame k white while PATTERN[k // 2] (else black; `steady`: always white), and
    a 440 Hz tone exactly while a white frame is shown. The video's first frame is shown at `video_start`
    seconds on the container's clock, the sound starts at 0 (`early_noise`: loud noise before the first
    frame)."""
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
        audio = container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")
        for k, bit in enumerate(bits):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 255 * bit, np.uint8), format="rgb24")
            frame.pts, frame.time_base = round(1000 * (video_start + k / FPS)), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        write_sound(container, audio, np.repeat(sound[None].astype(np.float32), channels, 0))


def planned(path: Path, frames: int, target_fps: float = 0.0, seed: int = 0) -> data.Item:
    cfg = DataConfig(data_root=str(path.parent), train_resolution=[frames, 32, 32], target_fps=target_fps)
    item = data.plan_clip(data.Clip(path, "flashes", 1, "videos.txt"), decode.probe(path), f"{path}", [(frames, 32, 32)],
                          cfg, seed)
    assert isinstance(item, data.Item), item
    return item


def assert_in_step(item: data.Item) -> None:
    """The window's sound is loud in each frame's seconds exactly when that frame is white, and lasts
    as long as the frames."""
    frames, rate = item.resolution[0], item.rate
    video = data.decode_clip(item)
    sound = data.decode_audio(item, RATE, 2)
    assert sound.shape == (2, round(frames / rate * RATE))
    white = [bool(v > 128) for v in video.float().mean(dim=(1, 2, 3))]
    slot, edge = RATE / rate, round(0.02 * RATE)  # away from each slot's edges: codecs smear a switch over ms
    loud = [bool(sound[:, round(j * slot) + edge : round((j + 1) * slot) - edge].pow(2).mean().sqrt() > 0.05)
            for j in range(frames)]
    assert loud == white, f"start {item.start} at {rate} fps"
    assert any(white) and not all(white)


@pytest.mark.parametrize("kind", ["mp4", "mkv"])
def test_sound_covers_exactly_the_planned_frames(tmp_path, kind):
    """AAC in mp4 and Opus in Matroska: the sound of the window the plan picks (a clip longer than its
    bucket, so the start is drawn), of other starts, and at another frame rate, matches its frames."""
    path = tmp_path / f"flashes.{kind}"
    write_flashes(path, kind)
    item = planned(path, 17)
    for start in {item.start, 0, 5, 23}:
        assert_in_step(dataclasses.replace(item, start=start))
    slower = planned(path, 9, target_fps=4)
    for start in (0, 3, 11):
        assert_in_step(dataclasses.replace(slower, start=start))


def test_sound_follows_the_first_frame_not_the_stream_start(tmp_path):
    """A video stream that starts 0.5 s after its audio (noise until then, mono): the window is timed
    from the first frame, on both streams' clock."""
    path = tmp_path / "late.mkv"
    write_flashes(path, "mkv", video_start=0.5, channels=1, early_noise=True)
    item = planned(path, 17)
    for start in (0, 2, 9):
        assert_in_step(dataclasses.replace(item, start=start))


def test_frames_stamped_in_milliseconds_join_without_gaps(tmp_path):
    """AAC in Matroska: 1024-sample frames (23.2 ms) stamped in whole milliseconds. Placed by their
    stamps alone they would overlap or leave gaps, a click every frame; a steady tone decodes clean,
    nothing above 2 kHz."""
    path = tmp_path / "steady.mkv"
    write_flashes(path, "mka", steady=True)
    sound = data.decode_audio(planned(path, 17), RATE, 2)
    spectrum = torch.stft(sound[0], 1024, 160, window=torch.hann_window(1024), return_complex=True).abs()
    assert spectrum[128:].mean() < 1e-4 * spectrum.max()  # bins from 2 kHz up; clicks put 1e-3 there


def test_no_sound(tmp_path):
    """A video without an audio stream and an image have no sound (not silence); data.audio is the
    caller's switch."""
    make_synthetic_dataset(str(tmp_path), num_videos=1, frames=9)
    video = decode.probe(tmp_path / "videos/00000.mp4")
    item = planned(tmp_path / "videos/00000.mp4", 9)
    assert video.frames == 9 and data.decode_audio(item, RATE, 2) is None
    image = planned(tmp_path / "images/00000.png", 1)
    assert data.decode_audio(image, RATE, 2) is None


def test_undecodable_sound_is_a_bad_clip(tmp_path):
    """An AAC stream of garbage: the clip is bad input with the reason (cache.py lists it under
    data.skip_bad), its frames still decode."""
    path = tmp_path / "garbage.mp4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=44100, layout="stereo")
        for _ in range(16):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")))
        container.mux(stream.encode())
        noise = np.random.default_rng(0)
        for k in range(40):
            packet = av.Packet(noise.integers(0, 256, 300, dtype=np.uint8).tobytes())
            packet.stream, packet.pts, packet.dts, packet.duration = audio, k * 1024, k * 1024, 1024
            packet.time_base = Fraction(1, 44100)
            container.mux(packet)
    item = planned(path, 9)
    assert data.decode_clip(item).shape == (9, 32, 32, 3)
    with pytest.raises(data.BadClip, match="cannot decode its audio stream"):
        data.decode_audio(item, RATE, 2)


def test_mel_equals_the_reference():
    """Our log-mel against transformers' numpy implementation of the same transform (torchaudio's
    MelSpectrogram with the settings of LTX-2's audio processor: magnitude STFT, periodic Hann, centred
    with reflection, Slaney mel scale and norm, log floored at 1e-5), on a sweep with silence in it and
    on noise: equal in float64; float32 (what training uses) within its rounding near the floor."""
    t = torch.arange(RATE, dtype=torch.float64) / RATE
    waveform = torch.stack([0.4 * torch.sin(2 * torch.pi * (100 + 3000 * t) * t), 0.2 * torch.randn(RATE).double()])
    waveform[:, 4000:6000] = 0
    exact, rounded = decode.log_mel(waveform, RATE, 1024, 160, 64), decode.log_mel(waveform.float(), RATE, 1024, 160, 64)
    assert exact.shape == rounded.shape == (2, RATE // 160 + 1, 64) and rounded.dtype == torch.float32
    filters = mel_filter_bank(num_frequency_bins=513, num_mel_filters=64, min_frequency=0.0, max_frequency=RATE / 2,
                              sampling_rate=RATE, norm="slaney", mel_scale="slaney")
    for channel in range(2):
        reference = torch.from_numpy(spectrogram(
            waveform[channel].numpy(), window_function(1024, "hann", periodic=True), 1024, 160, power=1.0, center=True,
            pad_mode="reflect", mel_filters=filters, mel_floor=1e-5, log_mel="log", dtype=np.float64).T)
        torch.testing.assert_close(exact[channel], reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(rounded[channel], reference.float(), rtol=0, atol=1e-2)


def test_resampling_keeps_time_and_pitch():
    """A 1 kHz sine at 44.1 and 48 kHz, resampled to 16 kHz, is the same sine sampled at 16 kHz: no
    delay, no change of pitch or level (away from the ends, where the signal stops)."""
    for rate in (44100, 48000, 8000):
        sine = torch.sin(2 * torch.pi * 1000 * torch.arange(rate) / rate)[None].double()
        out = decode.resample(sine.float(), rate, RATE)
        expected = torch.sin(2 * torch.pi * 1000 * torch.arange(RATE) / RATE)[None]
        assert out.shape == (1, RATE)
        torch.testing.assert_close(out[:, 100:-100], expected[:, 100:-100], rtol=0, atol=2e-3 if rate > RATE else 1e-2)


def test_channels_mix_as_the_official_trainer_does():
    """Mono is copied to both sides; 5.1 keeps each side's front and adds the centre and that side's
    surround at 0.707, the LFE dropped, weights summing to 1; two channels to one average."""
    mono = torch.tensor([[1.0, -2.0]])
    assert decode.mix(mono, 2).tolist() == [[1.0, -2.0], [1.0, -2.0]]
    surround = torch.eye(6)  # one sample per channel: the columns are each channel's weights
    left, right = decode.mix(surround, 2)
    torch.testing.assert_close(left, torch.tensor([1, 0, 0.707, 0, 0.707, 0]) / 2.414)
    torch.testing.assert_close(right, torch.tensor([0, 1, 0.707, 0, 0, 0.707]) / 2.414)
    assert decode.mix(torch.tensor([[1.0], [3.0]]), 1).tolist() == [[2.0]]
