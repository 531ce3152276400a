"""Does a written export reproduce the student? Two rules, one per precision.

float32 (every export, reloaded in this process): the calls a user of the export makes, on fixed prompts of
different lengths (`CALLS`): a plain forward (`model(input_ids)`, every argument at its default), greedy `generate`
through the model's own cache, and the prompts as one left-padded batch with its attention mask (a forward and a
`generate`), each made of the export and of the student alike. The largest |logit difference| over every
prompt position of both forwards must stay within `LOGIT_TOLERANCE`, and greedy decoding must give the same
`GREEDY_TOKENS` tokens, alone and in the padded batch. A call the export cannot make fails the check, naming it.

bfloat16 (a serving engine, `engine_agreement`): token equality is not a fair test there, since a random or barely
trained model has near-tied tokens that bf16 rounding flips, exactly as a bf16 run of the student itself does. The
rule separates that noise from a conversion fault (a wrong norm convention costs about 40x the noise):
- tokens equal up to the first divergence, and there each side's token is in the other's top `TOP_K`;
- the engine's tokens scored by the float32 student (teacher-forced): the gap between the student's best logprob
  and the logprob of the engine's token stays below `MAX_GAP_NATS` at every step and below `MEAN_GAP_NATS` on
  average.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PARITY_TEXTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Shall I compare thee to a summer's day? Thou art more lovely",
)
RANDOM_PROMPT_LENGTHS = (12, 9, 5)  # tokens of the seeded prompts (a model whose vocabulary the tokenizer does not
# fit): of different lengths, so that their batch is padded
CALLS = ("plain forward", "generate with the cache", "left-padded batch (forward and generate)")
GREEDY_TOKENS = 16
LOGIT_TOLERANCE = 1e-4
TOP_K = 5
MAX_GAP_NATS = 1.0
MEAN_GAP_NATS = 0.3


def parity_prompts(tokenizer, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`PARITY_TEXTS` as token ids; seeded random ids instead when there is no tokenizer or its ids do not fit the
    model's vocabulary (the tiny test models)."""
    if tokenizer is not None:
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PARITY_TEXTS]
        if all(0 <= i < vocab_size for prompt in prompts for i in prompt):
            return prompts
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in RANDOM_PROMPT_LENGTHS]


@dataclass
class Parity:
    """What the float32 check found; `passed` applies the module's rule. `failed_call` names a call the export could
    not make (and what it raised)."""

    max_abs_logit_diff: float  # over every position of the plain forward and of the padded batch's forward
    greedy_identical: int  # prompts whose greedy continuation (generate, with the cache) is the same token for token
    padded_greedy_identical: int  # the same, each prompt generated in the left-padded batch
    prompts: int
    greedy_tokens: int
    tolerance: float
    calls: tuple = CALLS
    failed_call: str | None = None

    @property
    def passed(self) -> bool:
        return (self.failed_call is None and self.max_abs_logit_diff <= self.tolerance
                and self.greedy_identical == self.padded_greedy_identical == self.prompts)

    def record(self) -> dict:
        return {**asdict(self), "calls": list(self.calls), "passed": self.passed, "dtype": "float32"}

    def summary(self) -> str:
        if self.failed_call is not None:
            return f"the export fails a {self.failed_call}"
        return (f"max |logit diff| {self.max_abs_logit_diff:.3g} (tolerance {self.tolerance:g}), greedy "
                f"{self.greedy_identical}/{self.prompts} prompts identical over {self.greedy_tokens} tokens, "
                f"{self.padded_greedy_identical}/{self.prompts} in a left-padded batch")


@torch.no_grad()
def logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32: a plain forward, every argument at the model's default (its cache included)."""
    return model(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def greedy(model, prompt: list[int], tokens: int = GREEDY_TOKENS) -> list[int]:
    """`tokens` greedy tokens through the model's own cache (end-of-text suppressed, so every model runs as long)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [len(prompts), longest]: each prompt at the right end of its row."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.no_grad()
def padded_batch(model, prompts: list[list[int]],
                 tokens: int = GREEDY_TOKENS) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The prompts as one left-padded batch: (each prompt's [len, vocab] float32 logits from one forward with the
    attention mask, each prompt's `tokens` greedy tokens from one `generate` of the batch)."""
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    out = model(ids, attention_mask=mask).logits.float()
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                               do_sample=False, pad_token_id=0)
    return ([out[row, width - len(prompt):] for row, prompt in enumerate(prompts)],
            generated[:, width:].tolist())


def compare(reference, candidate, prompts: list[list[int]], tolerance: float = LOGIT_TOLERANCE) -> Parity:
    """The float32 rule: `candidate` (what was written, reloaded) against `reference` (the student), through each of
    `CALLS`."""
    expected = [logits(reference, prompt) for prompt in prompts]
    expected_greedy = [greedy(reference, prompt) for prompt in prompts]
    expected_padded, expected_padded_greedy = padded_batch(reference, prompts)
    worst, identical, padded_identical = 0.0, 0, 0
    call = CALLS[0]
    try:
        for prompt, want in zip(prompts, expected):
            worst = max(worst, (want - logits(candidate, prompt)).abs().max().item())
        call = CALLS[1]
        identical = sum(greedy(candidate, prompt) == want for prompt, want in zip(prompts, expected_greedy))
        call = CALLS[2]
        padded, padded_greedy = padded_batch(candidate, prompts)
    except Exception as err:  # noqa: BLE001 - whatever the written code raises, it fails this call of a user's
        cause = " ".join(str(err).split())[:200]
        return Parity(worst, identical, 0, len(prompts), GREEDY_TOKENS, tolerance,
                      failed_call=f"{call} ({type(err).__name__}: {cause})")
    worst = max([worst] + [(want - got).abs().max().item() for want, got in zip(expected_padded, padded)])
    padded_identical = sum(got == want for got, want in zip(padded_greedy, expected_padded_greedy))
    return Parity(worst, identical, padded_identical, len(prompts), GREEDY_TOKENS, tolerance)


@dataclass
class EngineAgreement:
    """The bfloat16 rule applied to one engine's greedy output on the fixed prompts."""

    equal_prefix: list[int]          # per prompt: tokens equal before the first divergence
    divergence_in_top_k: list[bool]  # per prompt: at the divergence each side's token is in the other's top k
    max_gap_nats: float
    mean_gap_nats: float

    @property
    def passed(self) -> bool:
        return all(self.divergence_in_top_k) and self.max_gap_nats < MAX_GAP_NATS and self.mean_gap_nats < MEAN_GAP_NATS

    def record(self) -> dict:
        return {**asdict(self), "passed": self.passed, "top_k": TOP_K, "max_gap_limit": MAX_GAP_NATS,
                "mean_gap_limit": MEAN_GAP_NATS}

    def summary(self) -> str:
        return (f"equal prefixes {self.equal_prefix}, divergences in each other's top {TOP_K}: "
                f"{self.divergence_in_top_k}, logprob gap max {self.max_gap_nats:.3f} nats (< {MAX_GAP_NATS}), mean "
                f"{self.mean_gap_nats:.3f} (< {MEAN_GAP_NATS})")


@torch.no_grad()
def engine_agreement(student, prompts: list[list[int]], engine_tokens: list[list[int]],
                     engine_top_k: list[list[list[int]]]) -> EngineAgreement:
    """Apply the bfloat16 rule. `engine_tokens[p]`: the engine's greedy tokens after prompt p; `engine_top_k[p][t]`:
    the engine's `TOP_K` most likely token ids at step t. The float32 student decodes greedily on its own and scores
    the engine's tokens teacher-forced (one forward over prompt + engine tokens)."""
    prefixes, in_top_k, gaps = [], [], []
    for prompt, tokens, top_k in zip(prompts, engine_tokens, engine_top_k, strict=True):
        own = greedy(student, prompt, len(tokens))
        forced = torch.log_softmax(logits(student, prompt + tokens)[len(prompt) - 1:-1], dim=-1)
        chosen = forced.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps += (forced.max(dim=-1).values - chosen).tolist()
        equal = next((t for t, (a, b) in enumerate(zip(own, tokens)) if a != b), len(tokens))
        prefixes.append(equal)
        if equal == len(tokens):
            in_top_k.append(True)
            continue
        student_top_k = forced[equal].topk(TOP_K).indices.tolist()
        in_top_k.append(tokens[equal] in student_top_k and own[equal] in top_k[equal])
    return EngineAgreement(prefixes, in_top_k, max(gaps), sum(gaps) / len(gaps))
