"""Synthetic retrieval sequences: a key-value statement hidden in ordinary text of one split, then asked back.

Two users read them, each from its own split: the `recall` retention policy probes the teacher with sequences cut
from the calibration split, and the training mix (`data.retrieval_mix`) puts sequences cut from the training split
into Stage 1 and Stage 2 batches. The evaluation split is never read here; RULER builds its own prompts, in its own
wording and key vocabulary (`tcal.evaluate.ruler`), from evaluation text.

A sequence is exactly `seq_len` tokens (so sequences batch without padding):

    [text][needle 1]...[text][needle k]...[text][question][answer]

The text is a contiguous slice of the split's token stream; each needle is inserted after a newline token of it
(anywhere when the slice has none). One of the k needles (k uniform in 1..`max_needles`) is asked; the others are
distractors with other keys and values. Keys are two words drawn from the split's own text, values 5 to 8 digits,
and the wording is one of `FORMATS`. Every token is labelled (`TEXT`, `NEEDLE`, `QUESTION`, `ANSWER`), so a probe
can compare the loss on the answer with the loss on the ordinary text of the same forward.

Everything is a function of the split's tokens, the tokenizer and the seed string the caller passes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

TEXT, NEEDLE, QUESTION, ANSWER = 0, 1, 2, 3

# (statement, question): the question ends where the value follows; `{key}` and `{value}` are filled in.
FORMATS = (
    ("The access code for the {key} is {value}.",
     "What is the access code for the {key}? The access code for the {key} is"),
    ("Remember this: {key} was given the number {value}.",
     "Which number was {key} given? {key} was given the number"),
    ("Note that the {key} is filed under {value}.",
     "Under which number is the {key} filed? The {key} is filed under"),
    ("{key}: {value}",
     "Look up {key} in the notes above. {key}:"),
)
MIN_WORD_LENGTH = 4
MAX_NEEDLES = 4


@dataclass(frozen=True)
class RetrievalSequence:
    """`ids` [seq_len] token ids and `labels` [seq_len] (TEXT, NEEDLE, QUESTION, ANSWER) of one sequence."""

    ids: torch.Tensor
    labels: torch.Tensor
    value: str


def key_words(text: str) -> list[str]:
    """The distinct alphabetic words of at least MIN_WORD_LENGTH letters in `text`, lower-cased, sorted."""
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text) if len(w) >= MIN_WORD_LENGTH})


class RetrievalSequences:
    """Builds `RetrievalSequence`s of `seq_len` tokens over one split (its token stream and its words)."""

    def __init__(self, stream: torch.Tensor, words: list[str], tokenizer, seq_len: int,
                 max_needles: int = MAX_NEEDLES):
        if len(words) < 2 * max_needles:
            raise ValueError(f"retrieval sequences need at least {2 * max_needles} distinct words of "
                             f"{MIN_WORD_LENGTH}+ letters in the split's text to make keys; it has {len(words)}")
        self.stream, self.words, self.tokenizer = stream, words, tokenizer
        self.seq_len, self.max_needles = int(seq_len), int(max_needles)
        present = stream.unique().tolist() if stream.numel() else []
        self.newline = torch.zeros(max(present, default=0) + 1, dtype=torch.bool)
        for i in present:
            if "\n" in tokenizer.decode([i]):
                self.newline[i] = True

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, rng: random.Random) -> RetrievalSequence:
        """One sequence, every choice drawn from `rng`."""
        statement, question = FORMATS[rng.randrange(len(FORMATS))]
        count = rng.randint(1, self.max_needles)
        keys: list[str] = []
        while len(keys) < count:
            key = f"{rng.choice(self.words)} {rng.choice(self.words)}"
            if key not in keys:
                keys.append(key)
        values = [str(rng.randint(10 ** (d - 1), 10 ** d - 1)) for d in (rng.randint(5, 8) for _ in keys)]
        asked = rng.randrange(count)
        needles = [self._encode(statement.format(key=k, value=v) + "\n") for k, v in zip(keys, values)]
        tail_q = self._encode("\n" + question.format(key=keys[asked]) + " ")  # the space is no retrieval
        tail_a = self._encode(values[asked])
        text_len = self.seq_len - sum(map(len, needles)) - len(tail_q) - len(tail_a)
        if text_len < 1:
            raise ValueError(f"retrieval sequences of {self.seq_len} tokens: the needles and question take "
                             f"{self.seq_len - text_len} tokens and leave no room for text; use longer sequences")
        if self.stream.numel() < text_len:
            raise ValueError(f"retrieval sequences of {self.seq_len} tokens need {text_len} tokens of text; the "
                             f"split has {self.stream.numel()}")
        start = rng.randrange(self.stream.numel() - text_len + 1)
        text = self.stream[start:start + text_len]
        after_newline = [p + 1 for p in torch.nonzero(self.newline[text], as_tuple=False).flatten().tolist()
                         if p + 1 < text_len]
        cuts = sorted(rng.choice(after_newline) if after_newline else rng.randrange(1, text_len + 1)
                      for _ in needles)
        ids: list[int] = []
        labels: list[int] = []
        previous = 0
        for cut, needle in zip(cuts, needles):
            ids += text[previous:cut].tolist() + needle
            labels += [TEXT] * (cut - previous) + [NEEDLE] * len(needle)
            previous = cut
        ids += text[previous:].tolist() + tail_q + tail_a
        labels += [TEXT] * (text_len - previous) + [QUESTION] * len(tail_q) + [ANSWER] * len(tail_a)
        return RetrievalSequence(torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                                 values[asked])

    def batch(self, seed: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, seq_len] ids, [n, seq_len] labels): sequence i drawn from `random.Random(f"{seed}:{i}")`."""
        made = [self.make(random.Random(f"{seed}:{i}")) for i in range(n)]
        return torch.stack([m.ids for m in made]), torch.stack([m.labels for m in made])


def probe_batch(docs, tokenizer, seq_len: int, num_prompts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_prompts, seq_len] ids, labels) of retrieval sequences cut from `docs` (the calibration split, for
    `retention=recall`'s probe), drawn from `seed`; ValueError when the documents or the length leave no room."""
    from tcal.data.documents import token_stream

    builder = RetrievalSequences(token_stream(docs, tokenizer), key_words("\n".join(d.text for d in docs)), tokenizer,
                                 int(seq_len))
    return builder.batch(f"recall:{int(seed)}", int(num_prompts))
