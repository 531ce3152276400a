"""The student's Gated DeltaNet mixer, the paper's "gdn_v4" (docs/method.md, section "The GDN layer").

The layer's maths is `tcal.student.gdn_torch` (torch alone, also the `hf` export's shipped code): parameter names and
shapes are fla's `GatedDeltaNet(expand_v=1, use_short_conv=False, use_gate=True)`, so a checkpoint loads into fla's
layer, and the projections, gates, l2norm and gated RMSNorm are plain torch. Here the student adds activation
checkpointing in training and the dispatch of the delta-rule recurrence: fla's chunked Triton kernel on CUDA where
the stack is right for it (`trainer.gdn_kernel`, `tcal.student.stack`), the pure-torch chunked recurrence
(`gdn_torch.chunk_gated_delta_rule_torch`) on CPU and wherever it is asked for, and a single recurrent step for
one-token decoding anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch.utils.checkpoint import checkpoint

from tcal.student import gdn_torch
from tcal.student.stack import gdn_kernel_for

log = logging.getLogger(__name__)

_announced: set[tuple[str, str]] = set()
_traced_kernels: list = []  # the stand-ins for the chunked kernel while `traced_kernel` is on (tcal-plan), last first


def kernel_path(device: torch.device | str, kernel: str | None) -> str:
    """Name of the delta-rule implementation a `kernel` (`fla`, `torch`) runs on `device` (printed once per device,
    recorded as `kernel_path`)."""
    return "fla-triton-chunk" if torch.device(device).type == "cuda" and kernel == "fla" else "torch-chunk"


def use_gdn_kernel(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """Every GDN layer of `model` (a student, or one layer) runs `kernel` (`fla` or `torch`: its run's choice,
    `tcal.run.Run.gdn_kernel`) from now on; returns `model`."""
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.kernel = kernel
    return model


def _announce(device: torch.device, kernel: str | None) -> None:
    path = kernel_path(device, kernel)
    if (device.type, path) not in _announced:
        _announced.add((device.type, path))
        log.info("GatedDeltaNet kernel path on %s: %s", device, path)


def kernel_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v, beta as fla's kernel takes them: in autocast's dtype when autocast is on for their device (bf16-mixed
    runs the kernel in bfloat16, as the matmuls around it; its state and log decay stay float32), else unchanged."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


@contextlib.contextmanager
def traced_kernel(kernel):
    """Within the block, every multi-token call of `gated_delta_rule` runs `kernel(q, k, v, g, beta, initial_state,
    output_final_state)` instead: how `tcal-plan` traces, on tensors of the meta device, what fla's CUDA kernel keeps
    for backward. One process-wide switch, for planning only."""
    _traced_kernels.append(kernel)
    try:
        yield
    finally:
        _traced_kernels.pop()


def gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, update_state: bool = False,
                     kernel: str | None = None):
    """o_t = S_t q_t / sqrt(K), S_t = exp(g_t)(S_{t-1} - beta_t S_{t-1} k_t k_t^T) + beta_t v_t k_t^T.

    q, k: [B, T, H, K] (already l2-normalized); v: [B, T, H, V]; g (log decay), beta: [B, T, H].
    The state is [B, H, K, V] in float32 on every path. Returns (o [B, T, H, V] float32, state or None).
    `update_state`: a one-token step writes its final state into `initial_state` (a contiguous float32 tensor
    outside autograd, e.g. the cache's) and returns that tensor. Several tokens run fla's kernel on CUDA when
    `kernel` is `fla` (None, from a caller outside a run: `trainer.gdn_kernel=auto`'s choice for this stack, with its
    refusal), the traced stand-in while `traced_kernel` is on, else torch (`gdn_torch.gated_delta_rule_torch`).
    """
    if q.shape[1] > 1 and _traced_kernels:
        return _traced_kernels[-1](q, k, v, g, beta, initial_state, output_final_state)
    if q.shape[1] > 1 and q.is_cuda and (kernel or gdn_kernel_for("auto", True)) == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v, beta = kernel_inputs(q, k, v, beta)
        o, state = chunk_gated_delta_rule(
            q, k, v, g=g.float(), beta=beta, scale=1.0 / math.sqrt(q.shape[-1]), initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        )
        return o.float(), state
    return gdn_torch.gated_delta_rule_torch(q, k, v, g, beta, initial_state, output_final_state, update_state)


class GatedDeltaNet(gdn_torch.GatedDeltaNet):
    """Gated DeltaNet token mixer with fla's parameter names; drop-in for a decoder layer's `self_attn`. The torch
    layer (`gdn_torch.GatedDeltaNet`) with its recurrence dispatched by `gated_delta_rule`, and the mixer recomputed
    in backward when `checkpoint_training` is on."""

    # Training only: keep just the input for backward and recompute the mixer there (about 170 MB less per layer at
    # 4 x 512 tokens, for about one more mixer forward). Set by the training stages.
    checkpoint_training = False
    # `fla` or `torch`, set by the run that uses the layer (`use_gdn_kernel`); None: `trainer.gdn_kernel=auto`,
    # decided for this layer at its first multi-token call on CUDA (a layer outside any run)
    kernel: str | None = None

    def delta_rule(self, q, k, v, g, beta, initial_state=None, output_final_state=False, update_state=False):
        """`gated_delta_rule` with this layer's kernel, its path announced once per device."""
        if self.kernel is None and q.is_cuda and q.shape[1] > 1:
            self.kernel = gdn_kernel_for("auto", True)
        _announce(q.device, self.kernel)
        return gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state, update_state, self.kernel)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, cache=None,
                linear_attention_mask: torch.Tensor | None = None, **kwargs):
        """The torch layer's decoder-layer interface; in training without a cache, with `checkpoint_training`, only
        the input is kept for backward."""
        if cache is None and self.checkpoint_training and self.training and torch.is_grad_enabled():
            return checkpoint(self._mix_out, hidden_states, linear_attention_mask, use_reentrant=False), None
        return super().forward(hidden_states, attention_mask, cache, linear_attention_mask, **kwargs)

    def _mix_out(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.project_out(self.mix(x, mask)[0], x)
