"""Token windows: evenly spread calibration windows and the unseen windows between them."""

from __future__ import annotations

import pytest
import torch

from tcal.data.documents import Document, between_windows, token_windows


class CountingTokenizer:
    """Each whitespace word is its integer value; EOS is -1."""

    eos_token_id = -1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}


def docs(n_tokens: int) -> list[Document]:
    """One document whose stream is 0, 1, ..., n_tokens - 2, EOS."""
    return [Document("d", " ".join(str(i) for i in range(n_tokens - 1)))]


def test_token_windows_spread_evenly():
    windows = token_windows(docs(100), CountingTokenizer(), 10, 4)
    assert windows[:, 0].tolist() == [0, 30, 60, 90]  # stride (100 - 10) // 3
    assert torch.equal(windows[1], torch.arange(30, 40))


def test_between_windows_sit_midway_and_never_overlap():
    tok = CountingTokenizer()
    windows, between = token_windows(docs(100), tok, 10, 4), between_windows(docs(100), tok, 10, 4)
    assert between[:, 0].tolist() == [15, 45, 75]
    seen = set(windows.flatten().tolist())
    assert not seen & set(between.flatten().tolist())


def test_between_windows_edge_cases():
    tok = CountingTokenizer()
    assert between_windows(docs(100), tok, 10, 1) is None
    with pytest.raises(ValueError, match="no room between 4 windows of 20 tokens in 100 tokens; need 140"):
        between_windows(docs(100), tok, 20, 4)
    with pytest.raises(ValueError, match="5 windows of 30 tokens need 150 tokens"):
        between_windows(docs(100), tok, 30, 5)
