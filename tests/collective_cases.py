"""What each of 2 gloo ranks sees when a decision or a step fails on one rank only (run by
tests/test_distributed.py in spawned processes; kept apart from the test module so that a rank imports only
what it needs). Every case runs on both ranks in the same order, so a rank that left a collective early would
leave the other waiting: the next cases (and the process group's short timeout) would show it."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tcal.errors import ConfigError, FolderInUse
from tcal.runtime.distributed import Ranks, split_work
from tcal.store.cache import Codec, get_or_build_each, json_codec, save_json

TIMEOUT = timedelta(seconds=60)


class NeedsTwoArguments(Exception):
    """An error that does not survive pickling (its constructor takes two arguments)."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


def fail(error: Exception):
    raise error


def decide_value(ranks: Ranks, folder: Path):
    return ranks.decide(lambda: f"decided by rank {ranks.rank}")


def decide_refusal(ranks: Ranks, folder: Path):
    return ranks.decide(lambda: fail(FolderInUse(f"{folder} holds a run of another config")))


def refusal_on_rank_1(ranks: Ranks, folder: Path):
    with ranks.together():
        if ranks.rank == 1:
            raise ConfigError("stage.lr_mixer=-1; expected a learning rate > 0")
    return "not reached"


def different_failures(ranks: Ranks, folder: Path):
    with ranks.together():
        raise ValueError("rank 0's failure") if ranks.rank == 0 else KeyError("rank 1's failure")


def unpicklable_failure_on_rank_1(ranks: Ranks, folder: Path):
    with ranks.together():
        if ranks.rank == 1:
            raise NeedsTwoArguments("layer 3", "out of memory")


def entry_missing_on_rank_1(ranks: Ranks, folder: Path):
    """Rank 1 looks at another cache folder than rank 0 (the ranks must share one): rank 0 reads the entry."""
    return get_or_build_each("demo", {"a": "key-a"}, lambda items: {item: "built" for item in items},
                             folder=folder / f"cache_{ranks.rank}", ranks=ranks)


def write_fails_on_rank_0(ranks: Ranks, folder: Path):
    plain = json_codec()

    def write(path, value, key):
        raise OSError(28, "No space left on device")

    codec = Codec(plain.suffix, write, plain.read)
    return get_or_build_each("demo", {"b": "key-b"}, lambda items: {item: "built" for item in items},
                             folder=folder / "shared", codec=codec, ranks=ranks)


def work_after_failures(ranks: Ranks, folder: Path):
    return {str(item): value for item, value in split_work(ranks, [1, 2, 3], lambda i: i * 10).items()}


CASES = [decide_value, decide_refusal, refusal_on_rank_1, different_failures, unpicklable_failure_on_rank_1,
         entry_missing_on_rank_1, write_fails_on_rank_0, work_after_failures]


def prepare(folder: Path) -> None:
    """The cache entry that only rank 0's folder holds."""
    save_json(folder / "cache_0" / "key-a.json", {"value": "cached"}, "key-a")


def run_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Every case on this rank; what it returned or raised, in `folder`/rank_<rank>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    ranks = Ranks(rank, world)
    seen = {}
    for case in CASES:
        try:
            seen[case.__name__] = {"returned": case(ranks, Path(folder))}
        except Exception as err:  # noqa: BLE001 - what was raised is the result
            seen[case.__name__] = {"raised": type(err).__name__, "message": str(err)}
    Path(folder, f"rank_{rank}.json").write_text(json.dumps(seen, indent=1))
    dist.destroy_process_group()
