"""Cache keys: digests of configs, tensors and teachers, shared by every on-disk cache of the project."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch


def plain(node) -> dict:
    """Settings (a dataclass of `tcal.settings`, or a mapping) as a plain dict."""
    return dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)


DIGEST_CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32 at a time: a tensor is hashed piece by piece


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as contiguous float32 bytes (what the digests hash for a tensor)."""
    return t.detach().float().cpu().contiguous().numpy().tobytes()


def update_with_tensor(h, t: torch.Tensor) -> None:
    """`h.update(tensor_bytes(t))`, streamed: the float32 bytes of at most DIGEST_CHUNK_ELEMENTS values exist at
    once, so hashing a model never holds a float32 copy of it (nor of its largest tensor)."""
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), DIGEST_CHUNK_ELEMENTS):
        h.update(tensor_bytes(flat[start:start + DIGEST_CHUNK_ELEMENTS]))


def digest(*parts) -> str:
    """Short sha256 of the parts: bytes as they are, a tensor as its `tensor_bytes` (streamed), anything else as
    sorted JSON."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            update_with_tensor(h, part)
        else:
            h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def teacher_fingerprint(teacher) -> str:
    """Digest of the teacher's config and every weight (about a second for a 135M model), memoized."""
    cached = getattr(teacher, "_tcal_fingerprint", None)
    if cached is None:
        h = hashlib.sha256(teacher.config.to_json_string().encode())
        for name, tensor in teacher.state_dict().items():
            h.update(name.encode())
            update_with_tensor(h, tensor)
        cached = teacher._tcal_fingerprint = h.hexdigest()[:20]
    return cached


def tokenizer_digest(tokenizer) -> str:
    """Digest of what turns text into ids: the tokenizer's class, its vocabulary and its end-of-text id."""
    return digest(type(tokenizer).__name__, tokenizer.get_vocab(), tokenizer.eos_token_id)


def weights_digest(module) -> str:
    """Digest of every tensor in `module.state_dict()` (their float32 values, in order, streamed): equal digests
    mean bit-identical weights."""
    return digest(*module.state_dict().values())


def file_identity(path: str | Path) -> list[int]:
    """[inode, size, mtime_ns, ctime_ns] of a file. A write through the kernel moves the mtime and the ctime, and no
    call sets a ctime back (`touch -d` moves it too), so while a file's identity is what it was, so is its content."""
    stat = os.stat(path)
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


_FILE_DIGESTS: dict[tuple, str] = {}  # (path, identity) -> sha256, for this process


def file_digest(path: str | Path) -> str:
    """sha256 of the file's bytes (hex), read 1 MiB at a time (about 1 GB/s): hashed once per process while the file's
    identity (`file_identity`) stays the same."""
    key = (str(Path(path).resolve()), *file_identity(path))
    if key not in _FILE_DIGESTS:
        with open(path, "rb") as handle:
            _FILE_DIGESTS[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _FILE_DIGESTS[key]


def seal(path: str | Path) -> dict:
    """What `unchanged` checks a file against later: its sha256 and its identity now."""
    return {"sha256": file_digest(path), "identity": file_identity(path)}


def unchanged(path: str | Path, sealed: dict) -> bool:
    """Whether the file holds the bytes it held when `sealed`: its identity unchanged (a stat, no read), or else its
    bytes hashed again to the sealed sha256 (a copied or moved file keeps its content, not its identity)."""
    try:
        return file_identity(path) == list(sealed["identity"]) or file_digest(path) == sealed["sha256"]
    except OSError:
        return False
