"""torchvision's C++ op schemas for a CPU torch: `import tcal.serving.torchvision_ops` defines them.

vLLM's CPU build pins a CPU torch, while the registry's torchvision is built for CUDA: its C++ ops do not load, and
`import torchvision` then fails registering fake kernels for two of them (`torchvision::nms`, `torchvision::qnms`).
vLLM imports torchvision on its own import (through transformers' image processors), in every process it starts,
including the subprocess that inspects an out-of-tree model, so the schemas must exist before any `import vllm`:
`make serve-check` puts `import tcal.serving.torchvision_ops` in a .pth file of the serve venv, which Python runs at
every start. Defining a schema gives the op no kernel: calling it still fails, and no text model calls it.
"""

from __future__ import annotations

import torch

SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def has_schema(qualified: str) -> bool:
    try:
        torch._C._get_schema(qualified, "")
    except RuntimeError:
        return False
    return True


def define_schemas() -> list[str]:
    """Define each of `SCHEMAS` that no loaded library defines; returns the names defined."""
    defined = []
    for name, schema in SCHEMAS.items():
        if not has_schema(f"torchvision::{name}"):
            torch.library.define(f"torchvision::{name}", schema)
            defined.append(name)
    return defined


DEFINED = define_schemas()
