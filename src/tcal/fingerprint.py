"""Cache keys: digests of configs, tensors and teachers, shared by every on-disk cache of the project."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
from omegaconf import OmegaConf


def plain(node) -> dict:
    """Settings (a dataclass of `tcal.config`, a config node or a mapping) as a plain dict, interpolations resolved."""
    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().float().cpu().contiguous().numpy().tobytes()


def digest(*parts) -> str:
    """Short sha256 of the parts: bytes as they are, anything else as sorted JSON."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def teacher_fingerprint(teacher) -> str:
    """Digest of the teacher's config and every weight (about a second for a 135M model), memoized."""
    cached = getattr(teacher, "_tcal_fingerprint", None)
    if cached is None:
        h = hashlib.sha256(teacher.config.to_json_string().encode())
        for name, tensor in teacher.state_dict().items():
            h.update(name.encode())
            h.update(tensor_bytes(tensor))
        cached = teacher._tcal_fingerprint = h.hexdigest()[:20]
    return cached


def tokenizer_digest(tokenizer) -> str:
    """Digest of what turns text into ids: the tokenizer's class, its vocabulary and its end-of-text id."""
    return digest(type(tokenizer).__name__, tokenizer.get_vocab(), tokenizer.eos_token_id)


def weights_digest(module) -> str:
    """Digest of every tensor in `module.state_dict()`: equal digests mean bit-identical weights."""
    return digest(*(tensor_bytes(t) for t in module.state_dict().values()))
