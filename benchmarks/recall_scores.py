"""The `recall` policy's probe on the default teacher (SmolLM2-135M) for several probe seeds: per seed and ratio the
keep list, the converted layers, the layers the rule scores (above the probe's noise) with their score and standard
error, the ranks of layers 7, 16 and 18 and the scoring seconds; then, per ratio, how many layers the keep lists of
two seeds differ by (the stability the policy promises: at most one).

    OMP_NUM_THREADS=1 python benchmarks/recall_scores.py --seeds 0,1,2 [--ratios 0.25,0.5,0.75] [retention overrides]

Scores are cached under the cache folder ($TCAL_CACHE_DIR or .cache/tcal), keyed like a run's: a seed already
scored by a `tcal retention=recall` run (or by this script) is read back, with the seconds its scoring took.
Extra arguments `key=value` set other retention.* settings (`scored=4`, `fill=uniform`, `num_prompts=16`).
"""

from __future__ import annotations

import argparse
import itertools
import json

from tcal import api
from tcal.arguments import number, numbers
from tcal.errors import ConfigError
from tcal.settings import RecallRetentionSettings

WATCHED = (7, 16, 18)  # the layers whose replacement removes SmolLM2's retrieval (docs/results.md, "Long context")


def setting(text: str):
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, None if value == "null" else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=numbers(number(int, at_least=0)), default=(0, 1, 2))
    parser.add_argument("--ratios", type=numbers(number(above=0, at_most=1)), default=(0.25, 0.5, 0.75))
    parser.add_argument("overrides", nargs="*", type=setting)
    args = parser.parse_args()
    try:  # every probe's settings checked before the teacher loads
        cfgs = {(seed, ratio): RecallRetentionSettings(ratio=ratio, probe_seed=seed, **dict(args.overrides))
                for seed in args.seeds for ratio in args.ratios}
    except (ConfigError, TypeError) as err:
        parser.error(str(err))
    teacher, splits = api.load_teacher(), api.load_data()
    layers = teacher.model.config.num_hidden_layers
    keeps: dict[float, dict[int, list[int]]] = {}
    for seed in args.seeds:
        for ratio in args.ratios:
            cfg = cfgs[(seed, ratio)]
            selection = api.select_layers(teacher, splits, cfg)
            details = selection.details
            keeps.setdefault(ratio, {})[seed] = selection.keep_layers
            print(json.dumps({"seed": seed, "ratio": ratio, "keep": selection.keep_layers,
                              "converted": [i for i in range(layers) if i not in selection.keep_layers],
                              "chosen_by_score": details["scored_layers"], "rule": details["rule"],
                              "above_noise": {i: [round(selection.scores[i], 3), round(details["se"][str(i)], 3)]
                                              for i in details["above_noise"]},
                              **{f"rank_{i}": details["rank"][str(i)] for i in WATCHED},
                              "scoring_seconds": details["seconds"], "probe_tokens": details["tokens"],
                              "scores": {i: round(v, 4) for i, v in selection.scores.items()}}), flush=True)
    for ratio, by_seed in keeps.items():
        for (a, keep_a), (b, keep_b) in itertools.combinations(by_seed.items(), 2):
            print(json.dumps({"ratio": ratio, "seeds": [a, b], "layers_differing": len(set(keep_a) - set(keep_b))}))


if __name__ == "__main__":
    main()
