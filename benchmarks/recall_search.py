"""The `recall` policy's search on the student (`retention.search=greedy`) on the default teacher (SmolLM2-135M) for
several probe seeds and ratios: per seed and ratio the rule's keep list, the searched one, the accepted swaps, the
path's figures, why it stopped and its seconds; per ratio how many layers two seeds' searched lists differ by; and,
with `--curve N`, the student's answer and text loss on the probe's sequences as the searched list of the first seed
grows by N layers, in the order of its add pass's gains (the retrieval curve against the number of kept layers).

    OMP_NUM_THREADS=1 python benchmarks/recall_search.py --seeds 0,1,2 --ratios 0.25,0.5 [--curve 7] [tcal overrides]

The overrides are `tcal`'s (default: `init=phase2`); the settings are composed as `tcal retention=recall
retention.search=greedy <overrides>` composes them, so a search, a probe or a calibrated layer that a `tcal` run with
the same settings computed is read back from the cache ($TCAL_CACHE_DIR or .cache/tcal) with the seconds it took.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

from tcal import api
from tcal.arguments import number, numbers
from tcal.errors import ConfigError
from tcal.retention.ga_s2 import initialized_gdns
from tcal.retention.probe import probe_sequences
from tcal.retention.search import Students, mean_column
from tcal.settings.compose import settings_for


def rounded(value, places: int = 4):
    return round(value, places) if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=numbers(number(int, at_least=0)), default=(0, 1, 2))
    parser.add_argument("--ratios", type=numbers(number(above=0, at_most=1)), default=(0.25, 0.5))
    parser.add_argument("--curve", type=number(int, at_least=0), default=0,
                        help="layers to add to the first seed's searched lists")
    parser.add_argument("overrides", nargs="*", default=["init=phase2"])
    args = parser.parse_args()
    try:  # every search's settings checked before the teacher loads
        base = settings_for("retention=recall", "retention.search=greedy", *args.overrides)
        runs = {(ratio, seed): dataclasses.replace(base, retention=dataclasses.replace(base.retention, ratio=ratio,
                                                                                      probe_seed=seed))
                for ratio in args.ratios for seed in args.seeds}
    except ConfigError as err:
        parser.error(str(err))
    teacher, splits = api.load_teacher(base.teacher), api.load_data(base.data)
    layers = teacher.num_layers
    keeps: dict[float, dict[int, list[int]]] = {}
    searches: dict[tuple[int, float], tuple] = {}
    for ratio in args.ratios:
        for seed in args.seeds:
            settings = runs[(ratio, seed)]
            selection = api.select_layers(teacher, splits, settings.retention, settings.init, settings.calibration,
                                          settings.seed, data=settings.data, trainer=settings.trainer)
            search = selection.details["search"]
            keeps.setdefault(ratio, {})[seed] = selection.keep_layers
            searches[(seed, ratio)] = (settings, search)
            print(json.dumps({"seed": seed, "ratio": ratio, "init": search["init"], "rule": search["start"],
                              "scored": selection.details["scored_layers"], "searched": selection.keep_layers,
                              "converted": [i for i in range(layers) if i not in selection.keep_layers],
                              "swaps": search["swaps"], "forwards": search["forwards"], "budget": search["budget"],
                              "stopped": search["stopped"], "search_seconds": search["seconds"],
                              "init_seconds": search["init_seconds"],
                              "teacher_answer_nll": rounded(selection.details["base_answer_nll"]),
                              "teacher_text_nll": rounded(selection.details["base_text_nll"]),
                              "path": [{k: rounded(v) for k, v in entry.items() if k not in ("losses", "keep")}
                                       for entry in search["path"]]}), flush=True)
    for ratio, by_seed in keeps.items():
        for (a, keep_a), (b, keep_b) in itertools.combinations(by_seed.items(), 2):
            print(json.dumps({"ratio": ratio, "seeds": [a, b], "layers_differing": len(set(keep_a) - set(keep_b))}))
    if args.curve:
        first = args.seeds[0]
        for ratio in keeps:
            settings, search = searches[(first, ratio)]
            ctx = api.Run.build(settings, ("select",), teacher, splits)
            gains = {int(e["move"].split()[1]): e["gain"] for e in search["path"] if e["move"].startswith("add ")}
            order = sorted((j for j in gains if j not in search["keep"]), key=lambda j: (-gains[j], j))
            ids, labels = probe_sequences(settings.retention, ctx)
            students = Students(teacher.model, initialized_gdns(ctx), ids, labels, int(settings.retention.batch_size),
                                settings.init.gqa_expansion, int(settings.seed))
            keep = list(search["keep"])
            for step in range(args.curve + 1):
                begun = time.perf_counter()
                rows = students.losses(keep)
                point = {"seed": first, "ratio": ratio, "kept": len(keep), "keep": sorted(keep),
                         "answer": rounded(mean_column(rows, 0)), "text": rounded(mean_column(rows, 1)),
                         "seconds": round(time.perf_counter() - begun, 1)}
                print(json.dumps({"curve": point}), flush=True)
                if step < len(order):
                    keep.append(order[step])


if __name__ == "__main__":
    main()
