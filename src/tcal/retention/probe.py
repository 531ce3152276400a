"""The retrieval probe's sequences and forwards, shared by the `recall` policy (the teacher with a layer bypassed or
converted) and its search (students): the needle sequences of a probe seed, each sequence's answer and text loss,
and the replay of the layers below the first one a forward changes (their outputs recorded once, then returned
without computing them)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tcal.data.needles import ANSWER, TEXT, probe_batch
from tcal.evaluate.perplexity import token_nll
from tcal.teachers import adapter_for


def probe_sequences(retention, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_prompts, seq_len] ids, labels) cut from the calibration split, drawn from `probe_seed`."""
    return probe_batch(ctx.splits.calibration, ctx.tokenizer, int(retention.seq_len), int(retention.num_prompts),
                       int(retention.probe_seed))


@torch.no_grad()
def sequence_losses(model, ids: torch.Tensor, labels: torch.Tensor) -> list[list[float]]:
    """[[mean NLL of the ANSWER tokens, mean NLL of the TEXT tokens] per sequence] of `model`, teacher-forced
    (float64 sums; a token counts when it is predicted, i.e. from position 1 on)."""
    nll = token_nll(model, ids).double().cpu()
    target = labels[:, 1:]
    rows = []
    for row, lab in zip(nll, target):
        rows.append([float(row[lab == label].mean()) for label in (ANSWER, TEXT)])
    return rows


class Replay(nn.Module):
    """A decoder layer's place holder that returns what the layer returned in the base forward."""

    def __init__(self, output, attention_type):
        super().__init__()
        self.output = output
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, *args, **kwargs):
        return self.output


@contextmanager
def layer_outputs_recorded(teacher):
    """Within the block, the outputs of the decoder layers are appended, in order, to the yielded list."""
    outputs: list = []
    layers = adapter_for(teacher.config).decoder_layers(teacher)
    handles = [layer.register_forward_hook(lambda module, args, output: outputs.append(output)) for layer in layers]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def earlier_layers_replayed(teacher, outputs: list, layer: int):
    """Within the block, decoder layers 0..layer-1 return their `outputs` of the base forward without computing:
    layer `layer` and the ones after it see exactly the input they would see after computing them."""
    layers = adapter_for(teacher.config).decoder_layers(teacher)
    originals = [layers[j] for j in range(layer)]
    try:
        for j in range(layer):
            layers[j] = Replay(outputs[j], getattr(originals[j], "attention_type", None))
        yield teacher
    finally:
        for j, original in enumerate(originals):
            layers[j] = original
