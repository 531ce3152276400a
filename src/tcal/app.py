"""`tcal`: the Hydra entry of the main job (see conf/config.yaml).

Run again into a folder that already holds a run of the same config (`hydra.sweep.dir=` of a finished or
interrupted sweep), a finished run is skipped and an unfinished one continues from its last checkpoint, so a
rerun of a sweep does no work twice; a folder holding a run of another config is refused (`tcal.rerun`).
`tcal resume=RUN_DIR` does the same for the run recorded there; overrides on resume must be safe to change.
In a sweep (`-m`), a failing job is recorded in its folder and the others run (`tcal.sweep`).

A configuration error (`tcal.errors.ConfigError`: a bad setting, unreadable data, or an unknown option of a
config group) prints one line on stderr and exits with code 2, before any work and without a traceback.
SIGTERM, SIGINT or SIGUSR1 (`tcal.signals`) leave the record saying so, print one line (a sweep: one per job
that did not run) and exit with 128 + the signal's number; a write the filesystem refuses is one line, exit 1.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tcal.arguments import check_arguments
from tcal.errors import ConfigError, Divergence
from tcal.record import RESULTS, RecordError, load_record, read_record
from tcal.results import WriteFailed
from tcal.settings import group_options
from tcal.signals import Interrupted, handling
from tcal.sweep import failed_jobs, interrupted_lines, sweep_job

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
CONFIG_ERROR_EXIT = 2


def resumed_config(run_dir: Path, cfg=None, overrides: list[str] = ()):
    """The resolved config a run recorded in its results.json, to continue that run exactly; `cfg` (this
    command's config) may change only the keys safe to change on resume (`tcal.rerun.resume_config`)."""
    results = Path(run_dir) / RESULTS
    if not results.is_file():
        raise ConfigError(f"resume={str(run_dir)!r}: no results.json there; expected a run folder of `tcal`")
    try:
        record = load_record(results)
    except RecordError as err:
        raise ConfigError(f"resume={str(run_dir)!r}: {err}; expected the record of a `tcal` run") from None
    if "config" not in record:
        raise ConfigError(f"resume={str(run_dir)!r}: {results} holds no config (its run failed before any work); "
                          f"expected the record of a run that started: run it again instead")
    recorded = OmegaConf.create(record["config"])
    recorded.resume = str(run_dir)
    if cfg is not None:
        from hydra import compose

        from tcal.rerun import resume_config
        recorded = resume_config(Path(run_dir), recorded, cfg, compose(config_name="config"), list(overrides))
    return recorded


def earlier_run(cfg, run_dir: Path) -> str:
    """What `run_dir` holds for `cfg`: "none" (nothing), "complete" or "unfinished"; a run of another config
    there is refused (FolderInUse). A damaged results.json is warned about and run again."""
    from tcal.rerun import folder_state
    return folder_state(Path(run_dir), read_record(run_dir), OmegaConf.to_container(cfg, resolve=True))


def run_in(cfg, run_dir: Path, ranks=None) -> None:
    """Run `cfg` in `run_dir`: skip it when already complete there, continue it when unfinished. The decision is
    taken once, before any rank writes: here, before this process starts the job's ranks (`tcal.rank`), or by
    rank 0 for all when the ranks were started from outside (SLURM)."""
    from tcal.distributed import launch, starts_ranks
    starts = ranks is None and starts_ranks(cfg.trainer)
    if not starts:
        ranks = ranks or launch(cfg.trainer)
    earlier = earlier_run(cfg, run_dir) if starts else ranks.decide(lambda: earlier_run(cfg, run_dir))
    if earlier == "complete":
        print(f"tcal: {run_dir} already holds this run, complete; nothing to do "
              f"(results: {Path(run_dir) / 'results.json'})", flush=True)
        return
    if earlier == "unfinished":
        print(f"tcal: {run_dir} holds this run, unfinished; continuing it", flush=True)
    if starts:
        from tcal.rank import run_ranks
        run_ranks(cfg, run_dir, resume=earlier == "unfinished")
    else:
        from tcal.pipeline import run
        run(cfg, run_dir, resume=earlier == "unfinished", ranks=ranks)


def chosen_options(override) -> list[str]:
    """The options a config-group override (parsed by Hydra) names: its value, each item of a list, each value of
    a choice or range sweep; none for a deletion, null, or a glob (Hydra matches it against the options)."""
    from hydra.errors import HydraException

    if override.is_sweep_override():
        try:
            return list(override.sweep_string_iterator())
        except HydraException:  # glob(...) needs Hydra's config loader; intervals are not options
            return []
    value = override.value()
    return [str(item) for item in (value if isinstance(value, list) else [value]) if item not in (None, "")]


def check_group_overrides(args: list[str]) -> None:
    """`group=option` arguments name existing options (Hydra's own message spans many lines). Arguments Hydra's
    override grammar does not read (flags, bad syntax) are left to `check_arguments`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException:
            continue
        key = override.key_or_group
        options = None if key.startswith("hydra") else group_options(key)
        for option in chosen_options(override) if options is not None else []:
            if option not in options:
                raise ConfigError(f"{key}={option!r}: no such option in config group {key!r}; "
                                  f"expected one of {', '.join(options)}")


def config_error_exit(err: Exception) -> None:
    print(f"tcal: configuration error: {err}", file=sys.stderr, flush=True)
    sys.exit(CONFIG_ERROR_EXIT)


def run_failed_exit(err: Exception, run_dir: Path) -> None:
    """A named failure of the run (divergence, a failed rank): one line, the record's path, exit code 1."""
    print(f"tcal: run failed: {err} (record: {Path(run_dir) / 'results.json'})", file=sys.stderr, flush=True)
    sys.exit(1)


def interrupted_exit(err: Interrupted) -> None:
    """A signal stopped the run (or the sweep): one line each for it and any sweep job that did not run, exit code
    128 + the signal's number."""
    for line in interrupted_lines(err):
        print(f"tcal: {line}", file=sys.stderr, flush=True)
    sys.exit(err.exit_code)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@handling
def hydra_main(cfg) -> None:
    from tcal.rank import RankFailed
    from tcal.validate import validate_config
    run_dir = Path(cfg.resume or HydraConfig.get().runtime.output_dir)
    try:
        with sweep_job(cfg, run_dir):
            if cfg.get("resume"):
                cfg = resumed_config(run_dir, cfg, HydraConfig.get().overrides.task)
            validate_config(cfg)  # before any rank starts
            run_in(cfg, run_dir)
    except ConfigError as err:
        config_error_exit(err)
    except (Divergence, RankFailed, WriteFailed) as err:
        run_failed_exit(err, run_dir)
    except Interrupted as err:
        err.run_dir = getattr(err, "run_dir", run_dir)
        raise


def main() -> None:
    """The `tcal` console script."""
    try:
        check_group_overrides(sys.argv[1:])
        check_arguments(sys.argv[1:])
    except ConfigError as err:
        config_error_exit(err)
    try:
        with handling():
            hydra_main()
    except Interrupted as err:
        interrupted_exit(err)
    if failed_jobs():
        sys.exit(1)


if __name__ == "__main__":
    main()
