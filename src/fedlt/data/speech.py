"""Speech Commands v2 as BalanceFL uses it: 35 keywords, one-second wav files -> 32x32 log-mel spectrograms.

BalanceFL's ``Speech/data/ImbalanceSpeech.py`` (torchaudio + librosa there; torch alone here): a 16 kHz
waveform in [-1, 1), a mel power spectrogram (Hann window, n_fft 1024 and hop 512 when the clip is longer
than 9 x 1024 samples, else 512 and 256; centred frames with reflection padding; 32 HTK mel bands from 0 to
8 kHz, no filter normalisation), converted to decibels as librosa's ``power_to_db`` (10 log10 max(1e-10, P),
floored at 80 dB below the clip's maximum); a clip with other than 32 frames is reshaped to 32 x 32 with
numpy's ``resize`` (cyclic, as BalanceFL); finally ``(dB + 9) / 61``. Labels follow BalanceFL's class order
(by training-set size); training = every clip not in ``validation_list.txt`` or ``testing_list.txt``, test =
``testing_list.txt``. BalanceFL's long tail: n_max 3000 (the default here) and rho 100, 23,463 clips.
"""
from __future__ import annotations

import math
import wave
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..registry import DATASETS
from .base import Dataset, candidate_dirs
from .store import Cache, file_signature, key_of

CLASSES = ["zero", "five", "yes", "seven", "nine", "one", "down", "no", "stop", "two", "go", "six", "on", "left",
           "eight", "right", "off", "three", "four", "up", "house", "wow", "dog", "marvin", "bird", "cat", "happy",
           "sheila", "bed", "tree", "backward", "visual", "learn", "follow", "forward"]  # BalanceFL's order
RATE, N_MELS, FRAMES = 16000, 32, 32
FOLDER = "speech_commands_v0.02"


def read_wav(path: Path) -> torch.Tensor:
    """A 16-bit PCM mono wav file as float32 in [-1, 1) (torchaudio's scaling)."""
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise DataError(f"{path}: expected 16-bit mono PCM, got {8 * w.getsampwidth()}-bit, "
                                f"{w.getnchannels()} channels")
            raw = w.readframes(w.getnframes())
            rate = w.getframerate()
    except (OSError, EOFError, wave.Error) as e:
        raise DataError(f"{path} is not a readable wav file: {e}") from None
    if rate != RATE:
        raise DataError(f"{path}: sample rate {rate}, expected {RATE}")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0)


def mel_filters(n_freqs: int, n_mels: int = N_MELS, rate: int = RATE) -> torch.Tensor:
    """Triangular HTK-mel filters [n_freqs, n_mels] from 0 Hz to rate / 2, unnormalised (torchaudio's default)."""
    hz_to_mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)  # noqa: E731
    freqs = torch.linspace(0, rate // 2, n_freqs, dtype=torch.float64, device="cpu")
    mels = torch.linspace(hz_to_mel(0.0), hz_to_mel(rate / 2), n_mels + 2, dtype=torch.float64, device="cpu")
    pts = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    diff = pts[1:] - pts[:-1]
    slopes = pts.unsqueeze(0) - freqs.unsqueeze(1)  # [n_freqs, n_mels + 2]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0).float()


def log_mel(waves: list[torch.Tensor]) -> np.ndarray:
    """BalanceFL's [1, 32, 32] inputs for clips (see the module docstring), before the (x + 9) / 61 scaling:
    [len(waves), 1, 32, 32]. Clips of the same length go through one batched STFT."""
    out = np.empty((len(waves), 1, N_MELS, FRAMES), dtype=np.float32)
    by_len: dict[int, list[int]] = {}
    for i, w in enumerate(waves):
        by_len.setdefault(len(w), []).append(i)
    for n, idx in by_len.items():
        n_fft, hop = (1024, 512) if n // 1024 > 8 else (512, 256)
        spec = torch.stft(torch.stack([waves[i] for i in idx]), n_fft, hop, n_fft,
                          torch.hann_window(n_fft, device="cpu"), center=True, pad_mode="reflect",
                          return_complex=True).abs().pow(2)  # [B, n_fft / 2 + 1, frames]
        mel = torch.matmul(mel_filters(n_fft // 2 + 1).T, spec).numpy().astype(np.float64)
        db = 10.0 * np.log10(np.maximum(1e-10, mel))
        db = np.maximum(db, db.max(axis=(1, 2), keepdims=True) - 80.0)
        for j, i in enumerate(idx):
            out[i] = db[j][None] if db.shape[2] == FRAMES else np.resize(db[j][None], (1, N_MELS, FRAMES))
    return out


def _spectrograms(clips: list[Path], chunk: int = 512):
    for s in range(0, len(clips), chunk):
        yield (log_mel([read_wav(p) for p in clips[s: s + chunk]]) + 9) / 61


def _clips(root: Path) -> tuple[list[Path], list[Path]]:
    """(training clips, test clips) in torchaudio's order (sorted paths)."""
    def listed(name):
        f = root / name
        if not f.is_file():
            raise DataError(f"speech-commands: {f} not found (the archive's split lists)")
        return {(root / line.strip()).resolve() for line in f.read_text().splitlines() if line.strip()}

    val, test = listed("validation_list.txt"), listed("testing_list.txt")
    clips = sorted(p for c in CLASSES for p in (root / c).glob("*.wav"))
    train = [p for p in clips if p.resolve() not in val and p.resolve() not in test]
    tests = [p for p in clips if p.resolve() in test]
    missing = sorted(test - {p.resolve() for p in tests})
    if missing:
        raise DataError(f"speech-commands: testing_list.txt names {missing[0]}, which is not there")
    return train, tests


@DATASETS.register("speech-commands")
def load_speech_commands(data_dir: str | None = None, **_) -> Dataset:
    """Speech Commands v2, BalanceFL's 35 keywords as 32x32 log-mel spectrograms (torch; cached); fedlt data fetch.

    ``--data-dir`` (or ``$FEDLT_DATA``) holding ``speech_commands_v0.02/`` (the extracted archive: one folder of
    wav files per keyword, ``validation_list.txt``, ``testing_list.txt``), or that folder itself. Training
    split in sorted path order (the partition-file index space). Defaults: ResNet-8 and n_max 3000.
    """
    dirs = [p for d in candidate_dirs(data_dir, "speech-commands", []) for p in (d / FOLDER, d)]
    root = next((d for d in dirs if (d / "testing_list.txt").is_file()), None)
    if root is None:
        raise DataError(f"speech-commands: {FOLDER}/testing_list.txt not found under "
                        f"{', '.join(map(str, dirs)) or 'no data dir'}; run `fedlt data fetch speech-commands`")
    train, test = _clips(root)
    cache = Cache("speech-commands", key_of(str(root.resolve()), file_signature(root / "testing_list.txt"),
                                            file_signature(root / "validation_list.txt"), len(train), len(test)))
    if cache.meta is None:
        cache.begin()
        try:
            arrays = {}
            for split, clips in (("train", train), ("test", test)):
                shape = (len(clips), 1, N_MELS, FRAMES)
                cache.write(f"x_{split}", _spectrograms(clips), np.float32, shape)
                labels = np.asarray([CLASSES.index(p.parent.name) for p in clips], dtype=np.int64)
                cache.write(f"y_{split}", [labels], np.int64, (len(clips),))
                arrays[f"x_{split}"], arrays[f"y_{split}"] = ("float32", shape), ("int64", (len(clips),))
            cache.finish(arrays)
        except BaseException:
            cache.abandon()
            raise
    return Dataset(name="speech-commands", x_train=cache.array("x_train"), y_train=cache.array("y_train"),
                   x_test=cache.array("x_test"), y_test=cache.array("y_test"), num_classes=len(CLASSES),
                   default_model="resnet8", class_names=list(CLASSES), lt_n_max=3000, source=str(root))
