"""Reading sound: a clip's audio as a model hears it.

A clip's first audio stream, cut to the seconds its frames cover on the same clock (both
streams' timestamps, measured from the first frame's display time: an audio stream may start before
or after the video), decoded in a child process (sound_decoder.py: a crashing decoder names the
clip), mixed to the channels a model takes and resampled with a windowed sinc (equal to torchaudio's
default, which the official LTX-2 trainer uses), then turned into the log-mel spectrogram an audio
VAE encodes.
"""

import functools
import math
import threading
from pathlib import Path

import numpy as np
import torch

import decode
import faults
from decode import Media, MediaError

# Decoded on each side of the window: a decoder restarted by a seek needs frames to settle
# (Opus: 80 ms), the resampler a few samples.
AUDIO_MARGIN_S = 0.5
RESAMPLE_TAPS = 6  # zero crossings on each side of the sinc (torchaudio's lowpass_filter_width)
RESAMPLE_ROLLOFF = 0.99  # cutoff as a share of the lower Nyquist frequency (torchaudio's rolloff)
# Louder than this, a decoded sample comes from a corrupt stream (a damaged Opus packet decodes to
# hundreds); lossy codecs overshoot full scale by a few dB at most.
LOUDEST = 4.0
# Past this many phase-kernel values, resample computes each output's weights where it needs them:
# 44,101 Hz to 16 kHz (no common factor) would take 16,000 kernels of 44,135 taps, 5.6 GB.
KERNEL_VALUES = 1 << 22
SOUND = "sinc-hann-6-0.99"  # part of the audio cache key: another resampler gives other latents
# clips whose sound this process decoded (the sound_segv fault)
_sounds, _sounds_lock = 0, threading.Lock()


def read_audio(
    path: Path, media: Media, start: float, duration: float, sample_rate: int, channels: int
) -> torch.Tensor | None:
    """The clip's sound from `start` seconds after its first frame is shown, for `duration` seconds:
    float32 [channels, round(duration * sample_rate)] at `sample_rate`; zeros where the stream has
    no sound (before it starts, after it ends). None when the file has no audio stream, or one
    without a single frame. Decoded in a child process (sound_decoder.py): a decoder that crashes
    names the clip."""
    global _sounds
    with _sounds_lock:
        _sounds += 1
        crash = faults.active("sound_segv", _sounds)
    try:
        found = decode.decode(
            str(path), media.first_pts, start - AUDIO_MARGIN_S, duration + 2 * AUDIO_MARGIN_S, crash
        )
    except decode.Failed as e:
        raise MediaError(str(e)) from None
    if found is None:
        return None
    rate, native = found
    peak = float(np.abs(native).max())
    if peak > LOUDEST:
        raise MediaError(
            f"its sound decodes to samples up to {peak:.3g}, far outside [-1, 1] (a corrupt "
            "stream): re-encode its sound or remove the clip"
        )
    waveform = resample(mix(torch.from_numpy(native), channels), rate, sample_rate)
    first = round(AUDIO_MARGIN_S * sample_rate)
    return waveform[:, first : first + round(duration * sample_rate)]


def mix(waveform: torch.Tensor, channels: int) -> torch.Tensor:
    """[C, N] samples to `channels` (1 or 2), as the official LTX-2 trainer mixes: mono is copied to
    both sides; 5.1 and 7.1 (FFmpeg's order: L, R, C, LFE, then the surrounds) keep each side's
    front, add the centre and that side's surrounds at 0.707 and drop the LFE, scaled so the weights
    sum to 1; any other layout is averaged; one channel out is the mean of two."""
    count = waveform.shape[0]
    if count in (6, 8):
        left, right = [0, 4, 6][: count // 2 - 1], [1, 5, 7][: count // 2 - 1]
        total = 1 + 0.707 * len(left)  # the front, then the centre and the surrounds of one side
        waveform = torch.stack(
            [
                (waveform[side[0]] + 0.707 * (waveform[2] + waveform[side[1:]].sum(0))) / total
                for side in (left, right)
            ]
        )
    elif count > 2:
        waveform = waveform.mean(0, keepdim=True)
    if channels == 1:
        return waveform.mean(0, keepdim=True)
    return waveform.expand(2, -1).clone() if waveform.shape[0] == 1 else waveform


def resample(waveform: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """[C, N] at `rate` to `new_rate`: a Hann-windowed sinc (RESAMPLE_TAPS zero crossings each side,
    cutoff RESAMPLE_ROLLOFF of the lower Nyquist), output sample j at input time j / new_rate (no
    delay); ceil(N * new_rate / rate) samples, in the waveform's dtype. The same filter as
    torchaudio.functional.resample's default."""
    divisor = math.gcd(rate, new_rate)
    rate, new_rate = rate // divisor, new_rate // divisor
    if rate == new_rate:
        return waveform
    samples = math.ceil(new_rate * waveform.shape[1] / rate)
    width = _width(rate, new_rate)
    if new_rate * (2 * width + rate) > KERNEL_VALUES:
        return _resample_pointwise(waveform, rate, new_rate, samples)
    kernels = _sinc_kernels(rate, new_rate)
    padded = torch.nn.functional.pad(waveform[:, None], (width, width + rate))
    # [C, new_rate phases, blocks]
    out = torch.nn.functional.conv1d(padded, kernels.to(waveform.dtype), stride=rate)
    return out.transpose(1, 2).reshape(waveform.shape[0], -1)[:, :samples]


def _width(rate: int, new_rate: int) -> int:
    """Input samples each side of an output sample within the filter's reach."""
    return math.ceil(RESAMPLE_TAPS * rate / (min(rate, new_rate) * RESAMPLE_ROLLOFF))


def _sinc(t: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """The filter's weight of input sample n for output sample m at t = n / rate - m / new_rate."""
    cutoff = min(rate, new_rate) * RESAMPLE_ROLLOFF  # in cycles per `rate` input samples, times 2
    t = (t * cutoff).clamp(-RESAMPLE_TAPS, RESAMPLE_TAPS)
    window = torch.cos(t * math.pi / RESAMPLE_TAPS / 2) ** 2
    sinc = torch.where(t == 0, 1.0, torch.sin(t * math.pi) / (t * math.pi).where(t != 0, 1.0))
    return sinc * window * cutoff / rate


@functools.lru_cache(maxsize=8)
def _sinc_kernels(rate: int, new_rate: int) -> torch.Tensor:
    """One kernel per output phase ([new_rate, 1, 2 * _width + rate], float64)."""
    width = _width(rate, new_rate)
    offsets = torch.arange(-width, width + rate, dtype=torch.float64)[None] / rate
    phases = -torch.arange(new_rate, dtype=torch.float64)[:, None] / new_rate
    return _sinc(offsets + phases, rate, new_rate)[:, None]


def _resample_pointwise(waveform: torch.Tensor, rate: int, new_rate: int, samples: int) -> torch.Tensor:
    """resample's filter, each output sample's weights computed for the inputs within its reach: for
    rates with little in common, whose phase kernels would not fit in memory. Chunks of 2**16
    outputs."""
    width, count = _width(rate, new_rate), waveform.shape[1]
    reach = torch.arange(-width, width + 2)
    chunks = []
    for first in range(0, samples, 1 << 16):
        m = torch.arange(first, min(first + (1 << 16), samples))[:, None]
        n = m * rate // new_rate + reach  # [outputs, inputs]: the inputs around each output's time
        weights = _sinc((n * new_rate - m * rate).double() / (rate * new_rate), rate, new_rate)
        weights = (weights * ((n >= 0) & (n < count))).to(waveform.dtype)  # zeros past either end
        chunks.append((waveform[:, n.clamp(0, count - 1)] * weights).sum(-1))
    return torch.cat(chunks, 1)


def log_mel(waveform: torch.Tensor, sample_rate: int, n_fft: int, hop: int, mel_bins: int) -> torch.Tensor:
    """[C, N] samples to the log-mel spectrogram LTX-2's audio VAE encodes (docs/models/ltx2.md,
    Audio input): [C, N // hop + 1, mel_bins], in the waveform's dtype. The magnitude (not power)
    STFT with a periodic Hann window of n_fft, centred with reflection; Slaney's mel scale and
    area-normalised filters from 0 Hz to Nyquist; the natural log, floored at 1e-5."""
    spectrum = torch.stft(
        waveform,
        n_fft,
        hop,
        window=torch.hann_window(n_fft, dtype=waveform.dtype),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    ).abs()
    # [C, mel_bins, frames]
    mel = _mel_filters(sample_rate, n_fft, mel_bins).to(spectrum.dtype).T @ spectrum
    return mel.clamp(min=1e-5).log().transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _mel_filters(sample_rate: int, n_fft: int, mel_bins: int) -> torch.Tensor:
    """Triangular filters [n_fft // 2 + 1, mel_bins] (float64), evenly spaced on Slaney's mel scale
    (linear below 1 kHz, logarithmic above), each scaled by 2 / its width in Hz."""

    def to_mel(hz):
        return torch.where(hz < 1000, hz * 3 / 200, 15 + torch.log(hz / 1000) * 27 / math.log(6.4))

    def to_hz(mel):
        return torch.where(mel < 15, mel * 200 / 3, 1000 * torch.exp((mel - 15) * math.log(6.4) / 27))

    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    top = float(to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64)))
    edges = to_hz(torch.linspace(0, top, mel_bins + 2, dtype=torch.float64))
    rising = (freqs[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[None, 2:] - freqs[:, None]) / (edges[2:] - edges[1:-1])
    return torch.minimum(rising, falling).clamp(min=0) * 2 / (edges[2:] - edges[:-2])
