"""RULER-style synthetic long-context tasks over held-out text, scored by exact match.

Needles (key -> number statements, or chains of variable assignments) are hidden in a haystack of
held-out lines that fills the prompt to about `length` tokens of the model's own tokenizer.
"""

from __future__ import annotations

import logging
import math
import random
import string
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from tcal.runtime.progress import progress
from tcal.settings.evaluation import NEEDLE_TASKS
from tcal.settings.evaluation import RULER_TASKS as TASKS

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)

_ADJECTIVES = ("amber", "brisk", "calm", "dusky", "eager", "fallow", "gentle", "hollow", "idle", "jolly",
               "keen", "lofty", "mellow", "noble", "olive", "placid", "quiet", "rustic", "silver", "tawny")
_NOUNS = ("anchor", "badger", "candle", "dagger", "ember", "falcon", "garden", "harbor", "island", "jester",
          "kettle", "lantern", "meadow", "needle", "orchard", "pillar", "quarry", "raven", "saddle", "thistle")
_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
          "I will quiz you about the numbers afterwards.\n")
_VT_INTRO = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
_NUM_KEYS = 4      # needles in niah_multikey (one asked, the rest distract)
_NUM_VALUES = 4    # values of the single key in niah_multivalue
_CHAIN_HOPS = 4    # variables per chain in variable_tracking


def make_ruler_examples(documents: list[str], tokenizer, length: int, task: str, n: int,
                        seed: int) -> list[dict]:
    """`n` examples {"prompt", "answer", "task", "length"} of about `length` tokens, deterministic from the seed."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {TASKS}")
    lines = [line.strip() for doc in documents for line in doc.splitlines() if line.strip()]
    if not lines:
        raise ValueError("RULER tasks need non-empty held-out documents")
    rng = random.Random(f"{seed}:{task}:{length}")
    examples = []
    for _ in range(n):
        needles, question, answer = _NEEDLE_BUILDERS[task](rng)
        intro = _VT_INTRO if task == "variable_tracking" else _INTRO
        overhead = _count(tokenizer, intro + "\n".join(needles) + "\n" + question + " " + answer)
        haystack = _haystack(lines, tokenizer, length - overhead, rng)
        if not haystack:
            raise ValueError(f"{task} at length {length}: the needles and question ({overhead} tokens) "
                             "leave no room for haystack text")
        positions = sorted(rng.randint(0, len(haystack)) for _ in needles)
        for offset, (needle, pos) in enumerate(zip(needles, positions)):
            haystack.insert(pos + offset, needle)
        prompt = intro + "\n".join(haystack) + "\n" + question
        examples.append({"prompt": prompt, "answer": answer, "task": task, "length": length})
    return examples


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _haystack(lines: list[str], tokenizer, budget: int, rng: random.Random) -> list[str]:
    """Consecutive held-out lines from a random start (wrapping) until the next line would pass `budget` tokens.
    Every line is used at most once: a split whose lines run out before the budget cannot fill the prompt, and
    that is a ValueError rather than a shorter prompt recorded under the asked length."""
    start, taken, used = rng.randrange(len(lines)), [], 0
    while used < budget and len(taken) < len(lines):
        chunk = [lines[(start + len(taken) + k) % len(lines)] for k in range(min(64, len(lines) - len(taken)))]
        for line, ids in zip(chunk, tokenizer([text + "\n" for text in chunk], add_special_tokens=False)["input_ids"]):
            if used + len(ids) > budget:
                return taken
            taken.append(line)
            used += len(ids)
    if used < budget and taken:
        raise ValueError(f"the evaluation split's text runs out at {used} of the {budget} haystack tokens a prompt "
                         f"needs")
    return taken


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _distinct(make, count: int) -> list[str]:
    items: list[str] = []
    while len(items) < count:
        if (item := make()) not in items:
            items.append(item)
    return items


def _question(key: str) -> str:
    return (f"What is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


def _niah_single(rng):
    key, value = _key(rng), _number(rng)
    return [_needle(key, value)], _question(key), value


def _niah_multikey(rng):
    keys = _distinct(lambda: _key(rng), _NUM_KEYS)
    values = [_number(rng) for _ in keys]
    asked = rng.randrange(len(keys))
    return [_needle(k, v) for k, v in zip(keys, values)], _question(keys[asked]), values[asked]


def _niah_multivalue(rng):
    key = _key(rng)
    values = _distinct(lambda: _number(rng), _NUM_VALUES)
    question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                f"The special magic numbers for {key} mentioned in the provided text are")
    return [_needle(key, v) for v in values], question, ", ".join(values)


def _variable_tracking(rng):
    """One chain that carries the asked value and one distractor chain with another value."""
    names = _distinct(lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(5)), 2 * _CHAIN_HOPS)
    value, other = _number(rng), _number(rng)
    chains = [names[:_CHAIN_HOPS], names[_CHAIN_HOPS:]]
    statements = []
    for hop in range(_CHAIN_HOPS):
        for chain, start in zip(chains, (value, other)):
            rhs = start if hop == 0 else f"VAR {chain[hop - 1]}"
            statements.append(f"VAR {chain[hop]} = {rhs}.")
    question = (f"Question: Find all variables that are assigned the value {value} in the text above. "
                f"Answer: According to the chain(s) of variable assignment in the text above, "
                f"{_CHAIN_HOPS} variables are assigned the value {value}, they are:")
    return statements, question, ", ".join(chains[0])


_NEEDLE_BUILDERS = {"niah_single": _niah_single, "niah_multikey": _niah_multikey,
                    "niah_multivalue": _niah_multivalue, "variable_tracking": _variable_tracking}


def normalize_answer(text: str) -> str:
    """First line, stripped, final period dropped; comma lists compared as sorted sets."""
    line = text.strip().split("\n")[0].strip().rstrip(".").strip()
    return ", ".join(sorted(item.strip() for item in line.split(",")))


def score_ruler(model, tokenizer, documents: list[str], lengths=DEFAULT_LENGTHS, tasks=TASKS, n: int = 20,
                seed: int = 0, max_new_tokens: int | None = None, desc: str | None = None, ranks=None,
                batch_size: int = 1) -> dict[str, dict[str, float]]:
    """Exact-match accuracy of greedy generation: {str(length): {task: score}} (`cell_scores` over every length and
    task)."""
    cells = [(length, task) for length in lengths for task in tasks]
    scores: dict[str, dict[str, float]] = {}
    for (length, task), score in cell_scores(model, tokenizer, documents, cells, n, seed, max_new_tokens, desc, ranks,
                                             batch_size):
        scores.setdefault(str(length), {})[task] = score
    return scores


def cell_scores(model, tokenizer, documents: list[str], cells, n: int, seed: int, max_new_tokens: int | None = None,
                desc: str | None = None, ranks=None, batch_size: int = 1) -> Iterator[tuple[tuple[int, str], float]]:
    """((length, task), exact-match accuracy) of greedy generation over `n` examples, cell by cell as each is scored.

    A cell's examples depend on its own length and task and the seed only (`make_ruler_examples`), so a cell scores
    alike whichever cells are asked with it. Without `max_new_tokens`, each example may generate its answer's token
    count plus 8. With `desc`, a progress bar counts the examples. With `ranks` (`tcal.runtime.distributed.Ranks`,
    every rank calling), each rank generates its share of every cell's examples and the hit counts are summed over
    the ranks: every rank gets the scores. `batch_size` examples are generated together (`generated_tokens`).
    """
    share = ranks.share if ranks is not None else list
    for cell, (hits, total) in cell_hits(model, tokenizer, documents, cells, n, seed, max_new_tokens, desc, share,
                                         batch_size):
        if ranks is not None and ranks.distributed:
            parts = ranks.merge({ranks.rank: (hits, total)})
            hits, total = (sum(part[i] for part in parts.values()) for i in (0, 1))
        yield cell, hits / total if total else float("nan")


def cell_hits(model, tokenizer, documents: list[str], cells, n: int, seed: int, max_new_tokens: int | None = None,
              desc: str | None = None, share=list, batch_size: int = 1
              ) -> Iterator[tuple[tuple[int, str], tuple[int, int]]]:
    """((length, task), (exact matches, examples)) over `share(examples)` of each cell, cell by cell."""
    cells = [(int(length), task) for length, task in cells]
    per_cell = len(share(list(range(n))))  # this rank's examples of each cell
    with progress(total=len(cells) * per_cell, desc=desc, disable=desc is None, unit="example") as bar:
        for length, task in cells:
            bar.set_postfix_str(f"{task} @ {length}")
            mine = share(make_ruler_examples(documents, tokenizer, length, task, n, seed))
            replies = generated_tokens(model, tokenizer, mine, max_new_tokens, batch_size, done=bar.update)
            hits = sum(normalize_answer(tokenizer.decode(reply, skip_special_tokens=True))
                       == normalize_answer(example["answer"]) for reply, example in zip(replies, mine))
            yield (length, task), (int(hits), len(mine))


def examples_decoded_together(n: int, batch_size: int, world_size: int = 1) -> int:
    """The most examples one rank decodes at once: its share of a cell (`Ranks.share`, round robin: the first rank
    holds ceil(n / world_size)), `batch_size` at a time (`generated_tokens`)."""
    return min(int(batch_size), len(range(int(n))[::max(int(world_size), 1)]))


@torch.no_grad()
def generated_tokens(model, tokenizer, examples: list[dict], max_new_tokens: int | None = None, batch_size: int = 1,
                     done=lambda count: None) -> list[list[int]]:
    """Each example's greedy reply as token ids: at most its budget (`max_new_tokens`, else its answer's token count
    plus 8), up to and with the first end-of-text token, what `model.generate` gives the prompt alone.

    Examples are generated `batch_size` at a time, the longest prompts first (`generate_batch`); a model whose cache
    does not stack (`stacked_cache`) generates them one by one, with a warning. A batch runs to its largest budget
    and each row is cut to its own; a row that has ended is filled with padding, which the cut at its end token
    drops. `done(count)` after each batch.
    """
    prompts = [tokenizer(example["prompt"])["input_ids"] for example in examples]
    budgets = [max_new_tokens or _count(tokenizer, " " + example["answer"]) + 8 for example in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = _end_tokens(model, tokenizer)
    replies: list[list[int]] = [[] for _ in examples]
    order = sorted(range(len(examples)), key=lambda i: -len(prompts[i]))
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    while batches:
        rows = batches.pop(0)
        try:
            out = generate_batch(model, [prompts[i] for i in rows], max(budgets[i] for i in rows), pad)
        except UnstackableCache as why:
            log.warning("RULER examples generated one by one: %s", why)
            batches = [[i] for batch in (rows, *batches) for i in batch]
            continue
        width = max(len(prompts[i]) for i in rows)
        for row, i in enumerate(rows):
            reply = out[row, width:width + budgets[i]].tolist()
            stop = next((k + 1 for k, token in enumerate(reply) if token in ends), len(reply))
            replies[i] = reply[:stop]
        done(len(rows))
    return replies


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, pad: int) -> torch.Tensor:
    """Greedy `model.generate` of the prompts (token ids) together: [rows, longest prompt + new tokens], each prompt
    left-padded with `pad`.

    One prompt is `generate` on it alone. Of several, each prompt but its last token is run alone first, as one by
    one: a causal forward without padding (a padded batch hands the CPU attention kernel a mask, and then it
    computes the whole square instead of its causal half: 1.3x the prefill at 2,048 tokens). Their caches are
    stacked into one (`stacked_cache`) and `generate` continues the batch from the last prompt tokens under an
    attention mask over the padding: it numbers each row's positions from its first token (the mask's cumulative
    sum), and the softmax layers leave the padded positions out. A batched matmul may sum in another order than a
    row alone, so a greedy choice between two logits within rounding of each other could differ
    (tests/test_ruler.py checks the replies equal on the tiny teachers and SmolLM2's student).
    """
    device = getattr(model, "device", "cpu")
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    prefilled = {}
    if len(prompts) > 1:  # the rows' own caches live only until they are stacked
        prefilled["cache"] = stacked_cache([model(input_ids=ids[row:row + 1, width - len(prompt):-1], use_cache=True,
                                                  logits_to_keep=1).cache for row, prompt in enumerate(prompts)],
                                           width - 1)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad, **prefilled)


class UnstackableCache(ValueError):
    """A cache layer that `stacked_cache` cannot pad with zeros."""


def stacked_cache(caches: list, width: int):
    """One cache of `len(caches)` rows from caches of one row each (of one model), built in the first: every
    softmax layer's keys and values [1, H, n, D] left-padded with zeros to `width` positions and stacked, every
    linear-attention layer's recurrent state [1, ...] stacked. The padded positions are for an attention mask to
    leave out. A layer holding anything else (a sliding window's count, convolution states, quantized keys) raises
    UnstackableCache, naming it, before anything is changed."""
    first = caches[0]
    kinds = [_stacking(layer) for layer in first.layers]
    for index, (layer, kind) in enumerate(zip(first.layers, kinds)):
        if kind is None:
            raise UnstackableCache(f"cache layer {index} is a {type(layer).__name__}; only transformers' DynamicLayer "
                                   f"(or a subclass that changes only how it appends) and LinearAttentionLayer stack")
    for index, (layer, kind) in enumerate(zip(first.layers, kinds)):
        rows = [cache.layers[index] for cache in caches]
        if kind == "recurrent":
            for state, ready in layer.is_recurrent_states_initialized.items():
                if ready:
                    layer.recurrent_states[state] = torch.cat([row.recurrent_states[state] for row in rows])
        else:
            for name in ("keys", "values"):
                padded = [F.pad(getattr(row, name), (0, 0, width - getattr(row, name).shape[-2], 0)) for row in rows]
                setattr(layer, name, torch.cat(padded))
    return first


def _stacking(layer) -> str | None:
    """`recurrent` for a linear-attention layer holding recurrent states only; `kv` for a `DynamicLayer` whose state
    is its keys and values alone: the class itself or a subclass defined outside transformers that changes how it
    appends (the student's `GrowingKVLayer`; transformers' own subclasses keep more: a sliding window's count, an
    indexer's keys, quantized copies); None for anything else."""
    if type(layer) is LinearAttentionLayer:
        return None if any(layer.is_conv_states_initialized.values()) else "recurrent"
    if isinstance(layer, DynamicLayer) and (type(layer) is DynamicLayer
                                            or not type(layer).__module__.startswith("transformers.")):
        return "kv"
    return None


def _end_tokens(model, tokenizer) -> set[int]:
    """The ids that end generation: the model's generation config's end-of-text id(s), else the tokenizer's."""
    config = getattr(model, "generation_config", None)
    ends = getattr(config, "eos_token_id", None)
    if ends is None:
        ends = tokenizer.eos_token_id
    return set(ends) if isinstance(ends, (list, tuple)) else {ends}


def standard_error(p: float, n: int) -> float:
    """The binomial standard error sqrt(p (1 - p) / n) of an exact-match rate p over n examples."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else math.nan


def cell_summary(cells: list[tuple[float, int]]) -> dict | None:
    """{"mean", "se", "n"} over cells (rate, examples) of the same weight each: the mean of the rates, its standard
    error from the cells' binomial variances (independent examples), and the examples in all; None for no cell."""
    cells = [(p, n) for p, n in cells if p is not None and not math.isnan(p) and n > 0]
    if not cells:
        return None
    mean = sum(p for p, _ in cells) / len(cells)
    se = math.sqrt(sum(p * (1.0 - p) / n for p, n in cells)) / len(cells)
    return {"mean": mean, "se": se, "n": sum(n for _, n in cells)}


def ruler_summary(scores: dict[str, dict[str, float]], n: int | dict) -> dict:
    """{"needle", "other", "all"} -> `cell_summary` over the (length, task) cells of `scores`: the needle subtasks
    (`NEEDLE_TASKS`), the others, and every cell. `n` is the examples per cell, or {length: {task: n}}."""
    def examples(length, task):
        return int(n[length][task]) if isinstance(n, dict) else int(n)

    cells = [(task, score, examples(length, task)) for length, by_task in scores.items()
             for task, score in by_task.items()]
    return {"needle": cell_summary([(p, k) for t, p, k in cells if t in NEEDLE_TASKS]),
            "other": cell_summary([(p, k) for t, p, k in cells if t not in NEEDLE_TASKS]),
            "all": cell_summary([(p, k) for _, p, k in cells])}
