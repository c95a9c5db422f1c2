"""Durable weights: each published version is a safetensors file under the run directory, with its checksum.

A file is written to a temporary name, fsynced, renamed into place and its directory fsynced, so a crash
leaves either the whole file or none; `weights_published` names it (relative to the run directory) with
its SHA-256, and whoever loads it — an engine on a role switch, a resume, `gyre export` — checks the sum
first. The last ``keep`` versions are kept; versions a checkpoint still needs are never pruned.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.errors import GyreError

if TYPE_CHECKING:
    import torch

WEIGHTS_DIR = "weights"


class WeightsError(GyreError):
    """A weights file is missing or does not match its recorded checksum."""


@dataclass(frozen=True)
class Published:
    """The latest published weights as the core holds them: a version, its file and the file's checksum."""

    version: int
    location: str
    sha256: str


@dataclass(frozen=True)
class StoredWeights:
    version: int
    location: str
    """Relative to the run directory."""
    sha256: str
    bytes: int
    tensors: int
    duration_s: float


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then the directories, then its parent (a renamed tree is durable)."""
    for item in sorted(path.rglob("*")):
        if item.is_file():
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [*sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True), path, path.parent]:
        fsync_dir(directory)


def write_atomically(path: Path, write) -> None:
    """``write(tmp_path)`` then fsync, rename and fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class WeightStore:
    """The run's published weight versions."""

    def __init__(self, run_dir: Path, keep: int = 3) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep

    def location(self, version: int) -> str:
        return f"{WEIGHTS_DIR}/v{version:06d}.safetensors"

    def path(self, location: str) -> Path:
        return self.run_dir / location

    def save(self, version: int, tensors: dict[str, torch.Tensor], location: str | None = None) -> StoredWeights:
        from safetensors.torch import save_file

        started = time.perf_counter()
        location = location or self.location(version)
        path = self.path(location)
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        write_atomically(path, lambda tmp: save_file(contiguous, str(tmp), metadata={"policy_version": str(version)}))
        return StoredWeights(version, location, file_sha256(path), path.stat().st_size, len(contiguous),
                             time.perf_counter() - started)

    def verify(self, location: str, sha256: str) -> Path:
        """The file's path once its checksum matches the recorded one."""
        path = self.path(location)
        if not path.is_file():
            raise WeightsError(f"weights file {path} is missing")
        actual = file_sha256(path)
        if sha256 and actual != sha256:
            raise WeightsError(f"weights file {path} has checksum {actual}, but the log recorded {sha256}")
        return path

    def load(self, location: str, sha256: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.verify(location, sha256)))

    def prune(self, newest: int, protected: set[int] = frozenset()) -> list[int]:
        """Delete versions older than the last ``keep`` (except ``protected``); returns those deleted."""
        deleted = []
        for path in sorted((self.run_dir / WEIGHTS_DIR).glob("v*.safetensors")):
            if not path.stem[1:].isdigit():
                continue
            version = int(path.stem[1:])
            if version <= newest - self.keep and version not in protected:
                path.unlink()
                deleted.append(version)
        return deleted
