"""Byte-level corpus: the Python standard library's own top-level ``.py`` source.

Every machine with Python has it offline. Files are taken in sorted order of
their names and split by file: a file goes to validation when the CRC-32 of
its name is 0 mod ``VAL_EVERY`` (the same on every machine, unlike
``hash()``). Each split is cut at a fixed size, so the number of bytes is the
same everywhere; which bytes they are depends on the Python version (its
stdlib), see README.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig
import zlib

import numpy as np

VAL_EVERY = 10  # about 1 file in 10 is held out
TRAIN_BYTES = 2 * 2**20
VAL_BYTES = 256 * 2**10
FILE_SEPARATOR = b"\0"  # a byte Python source never holds: marks where a file ends


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The two splits as uint8 arrays, and the files each came from."""

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]

    def fingerprint(self) -> str:
        """Short SHA-256 of each split: equal fingerprints, equal corpora."""
        digest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()[:12]  # noqa: E731
        return f"train {digest(self.train)}, val {digest(self.val)}"


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
    """The top-level ``*.py`` files of the stdlib (no packages, no
    site-packages), sorted by name."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda p: p.name)


def is_validation(name: str) -> bool:
    return zlib.crc32(name.encode()) % VAL_EVERY == 0


def _concatenate(files, cap: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """Files joined by FILE_SEPARATOR until ``cap`` bytes, the last one cut."""
    parts, used, size = [], [], 0
    for path in files:
        if size >= cap:
            break
        parts.append(path.read_bytes() + FILE_SEPARATOR)
        used.append(path.name)
        size += len(parts[-1])
    data = np.frombuffer(b"".join(parts)[:cap], dtype=np.uint8)
    if len(data) < cap:
        raise ValueError(f"the stdlib holds {len(data)} bytes for this split, fewer than {cap}")
    return data, tuple(used)


def load_corpus(
    *, train_bytes: int = TRAIN_BYTES, val_bytes: int = VAL_BYTES, root: str | None = None
) -> Corpus:
    """The training and validation bytes, the same on every call."""
    files = stdlib_files(root)
    train, train_files = _concatenate([p for p in files if not is_validation(p.name)], train_bytes)
    val, val_files = _concatenate([p for p in files if is_validation(p.name)], val_bytes)
    return Corpus(train, val, train_files, val_files)


def sample_windows(data: np.ndarray, count: int, length: int, rng) -> np.ndarray:
    """``count`` random windows of ``length`` bytes, as int32 [count, length]."""
    starts = rng.integers(0, len(data) - length + 1, size=count)
    return data[starts[:, None] + np.arange(length)].astype(np.int32)


def fixed_windows(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` windows at evenly spaced offsets: the same for every seed
    and configuration, so validation losses compare."""
    starts = np.linspace(0, len(data) - length, count).astype(np.int64)
    return data[starts[:, None] + np.arange(length)].astype(np.int32)
