"""Does a written export reproduce the student? Two rules, one per precision.

float32 (every export, reloaded in this process): on fixed prompts, the largest |logit difference| over every
position must stay within `LOGIT_TOLERANCE`, and greedy decoding through each model's own cache must give the same
`GREEDY_TOKENS` tokens.

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
RANDOM_PROMPT_LENGTH = 12  # tokens of each seeded prompt, for a model whose vocabulary the tokenizer does not fit
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
    return [torch.randint(0, vocab_size, (RANDOM_PROMPT_LENGTH,), generator=generator).tolist()
            for _ in PARITY_TEXTS]


@dataclass
class Parity:
    """What the float32 check found; `passed` applies the module's rule."""

    max_abs_logit_diff: float
    greedy_identical: int  # prompts whose greedy continuation is the same token for token
    prompts: int
    greedy_tokens: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_logit_diff <= self.tolerance and self.greedy_identical == self.prompts

    def record(self) -> dict:
        return {**asdict(self), "passed": self.passed, "dtype": "float32"}

    def summary(self) -> str:
        return (f"max |logit diff| {self.max_abs_logit_diff:.3g} (tolerance {self.tolerance:g}), greedy "
                f"{self.greedy_identical}/{self.prompts} prompts identical over {self.greedy_tokens} tokens")


@torch.no_grad()
def logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt]), use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(model, prompt: list[int], tokens: int = GREEDY_TOKENS) -> list[int]:
    """`tokens` greedy tokens through the model's own cache (end-of-text suppressed, so every model runs as long)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def compare(reference, candidate, prompts: list[list[int]], tolerance: float = LOGIT_TOLERANCE) -> Parity:
    """The float32 rule: `candidate` (what was written, reloaded) against `reference` (the student)."""
    worst, identical = 0.0, 0
    for prompt in prompts:
        worst = max(worst, (logits(reference, prompt) - logits(candidate, prompt)).abs().max().item())
        identical += greedy(reference, prompt) == greedy(candidate, prompt)
    return Parity(worst, identical, len(prompts), GREEDY_TOKENS, tolerance)


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
