"""`tcal`: the Hydra entry of the main job (see conf/config.yaml).

The entry composes, converts the config into typed settings once (`tcal.settings.conversion.run_settings`) and hands
them to the library (`tcal.pipeline.run`). Before Hydra starts a job, every job of the command is composed and
converted here (`check_arguments`), so a bad setting is one line and exit code 2, before any work, and a sweep
with one bad job runs none.

Run again into a folder that already holds a run of the same settings (`hydra.sweep.dir=` of a finished or
interrupted sweep), a finished run is skipped and an unfinished one continues from its last checkpoint, so a
rerun of a sweep does no work twice; a folder holding a run of other settings is refused (`tcal.store.rerun`).
`tcal resume=RUN_DIR` does the same for the run recorded there; overrides on resume must change nothing of its
result. In a sweep (`-m`), a failing job is recorded in its folder and the others run (`tcal.cli.sweep`).

SIGTERM, SIGINT or SIGUSR1 (`tcal.runtime.signals`) leave the record saying so, print one line (a sweep: one per job
that did not run) and exit with 128 + the signal's number; a write the filesystem refuses is one line, exit 1.
"""

import errno
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from tcal.cli.sweep import failed_jobs, interrupted_lines, sweep_job
from tcal.errors import ConfigError, Divergence, config_error_exit
from tcal.runtime.signals import Interrupted, handling
from tcal.settings import RunSettings
from tcal.settings.compose import (
    CONF,
    check_plugins,
    compose_here,
    group_options,
    hydra_configs,
    one_job_per_group_choice,
    options_holding,
    parse,
    planned_jobs,
    plugin_search_path,
)
from tcal.settings.conversion import run_settings
from tcal.store.files import WriteFailed, in_the_way
from tcal.store.record import RESULTS, RecordError, load_record, read_record

CONF_DIR = str(CONF)
RUN_FLAGS = ("-m", "--multirun", "-r", "--run")  # flags that leave the overrides as they are
OUTPUT_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "resume")


def read_resumed(run_dir: Path) -> dict:
    """The record of the run `resume=RUN_DIR` names; ConfigError when there is none to continue."""
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
    return record


def recorded_run(run_dir: Path) -> RunSettings:
    """The settings of the run recorded in `run_dir` (`resume=RUN_DIR` continues with them)."""
    from tcal.store.rerun import recorded_settings

    return recorded_settings(Path(run_dir), read_resumed(run_dir))


def resumed(settings: RunSettings, defaults: RunSettings, overrides: list[str],
            choices: list[str] | tuple[str, ...] = ()) -> RunSettings:
    """The settings of the run `settings.resume` names, continued with this command's safe settings. `choices`: the
    run's own options the entry added to the command (`run_choices`), which the command does not set; `defaults`
    is what they compose alone."""
    from tcal.store.rerun import resumed_settings

    run_dir = Path(settings.resume)
    keys = [parse(arg).key_or_group.lstrip("+") for arg in overrides if arg not in choices]
    chosen = tuple(key.replace("/", ".") for key in keys if group_options(key) is not None)
    named = tuple(key for key in keys if group_options(key) is None)
    continued = resumed_settings(run_dir, read_resumed(run_dir), settings, defaults, chosen, named)
    continued.resume = str(run_dir)
    return continued


RESUME_CHOICES: list[str] = []  # the run's own options `main` adds to a `tcal resume=DIR` command (`run_choices`)


def run_choices(args: list[str], defaults: RunSettings) -> list[str]:
    """For a command with `resume=DIR`: the config-group options whose keys the recorded run's settings hold
    (`stage=distill` for a run of Stage 2, where the default `stage=none` has no `stage.lr_mixer`), for the groups the
    command does not choose: the command's overrides are read against the run's own settings, not the defaults'.
    `defaults`: the settings no override composes. [] without `resume=`, or when DIR holds no record to read (the
    resume then fails naming why)."""
    resume = next((parse(a) for a in args if _key(a) == "resume" and not parse(a).is_sweep_override()), None)
    if resume is None or not isinstance(resume.value(), str):
        return []
    try:
        recorded = recorded_run(Path(resume.value()))
    except ConfigError:
        return []
    chosen = {_key(a) for a in args if group_options(_key(a)) is not None}
    return [choice for choice in options_holding(recorded, defaults) if choice.split("=", 1)[0] not in chosen]


def _key(arg: str) -> str:
    return parse(arg).key_or_group.lstrip("+~")


def earlier_run(settings: RunSettings, run_dir: Path) -> str:
    """What `run_dir` holds for `settings`: "none" (nothing), "complete" or "unfinished"; a run of other settings
    there is refused (FolderInUse). A damaged results.json is warned about and run again."""
    from tcal.store.rerun import folder_state
    return folder_state(Path(run_dir), read_record(run_dir), settings)


def run_in(settings: RunSettings, run_dir: Path, ranks=None) -> None:
    """Run `settings` in `run_dir`: skip it when already complete there, continue it when unfinished. The decision
    is taken once, before any rank writes: here, before this process starts the job's ranks (`tcal.cli.rank`), or by
    rank 0 for all when the ranks were started from outside (SLURM)."""
    from tcal.preflight import check_resources, check_trainer
    from tcal.runtime.distributed import launch, starts_ranks
    from tcal.store.rerun import check_not_held, check_student_saved
    # Deliberately again in each rank's `Run.build`: here before any rank starts (`trainer=gpu` on a machine without
    # CUDA, more CPU ranks than CPUs: one line, not one per rank), there for ranks started from outside (SLURM)
    check_trainer(settings.trainer)
    check_resources(settings)
    starts = ranks is None and starts_ranks(settings.trainer)
    if not starts:
        ranks = ranks or launch(settings.trainer)
    earlier = earlier_run(settings, run_dir) if starts else ranks.decide(lambda: earlier_run(settings, run_dir))
    if earlier == "complete":
        check_student_saved(run_dir, read_record(run_dir), settings)
        print(f"tcal: {run_dir} already holds this run, complete; nothing to do "
              f"(results: {Path(run_dir) / 'results.json'})", flush=True)
        return
    if earlier == "unfinished":
        check_not_held(run_dir)
        print(f"tcal: {run_dir} holds this run, unfinished; continuing it", flush=True)
    if starts:
        from tcal.cli.rank import run_ranks
        run_ranks(settings, run_dir, resume=earlier == "unfinished")
    else:
        from tcal.pipeline import run
        run(settings, run_dir, resume=earlier == "unfinished", ranks=ranks)


# ------------------------------------------------------------------------------------------------ before Hydra


def check_arguments(args: list[str]) -> None:
    """Every job that `args` describe composes into settings (the first job of each combination of config-group
    choices, a sweep file's included); raises ConfigError with one line otherwise. First, every option is registered
    (tcal's and the plugins'), with the schemas conf/'s options open with, before Hydra composes anything."""
    check_plugins()
    if any(a.startswith("-") and a not in RUN_FLAGS for a in args):
        return  # --cfg, --info, -cn ...: Hydra's own modes
    overrides = [a for a in args if a not in RUN_FLAGS]
    multirun = any(a in ("-m", "--multirun") for a in args)
    for arg in overrides:
        group = parse(arg).key_or_group
        if parse(arg).is_delete() and group_options(group) is not None:
            raise ConfigError(f"{arg}: deletes the config group {group}, which every run has; expected "
                              f"{group}=<option> ({', '.join(group_options(group))})")
        if not multirun and parse(arg).is_sweep_override():
            raise ConfigError(f"{arg}: a sweep of values in a single run; expected tcal -m ... to run one job "
                              f"per value, or {arg.split('=', 1)[0]}=[...] for a list")
    from tcal.preflight import check_chosen_options

    with hydra_configs():
        defaults = None
        jobs = planned_jobs(overrides) if multirun else [overrides]
        for job in one_job_per_group_choice(jobs):
            place = job_place(job, overrides)
            try:
                choices = []
                if any(_key(arg) == "resume" for arg in job):
                    defaults = defaults or run_settings(compose_here([]))
                    choices = run_choices(job, defaults)
                cfg = compose_here([*choices, *job])
                settings = run_settings(cfg)
                check_chosen_options(settings)
                check_output_folders(settings, overrides)
                if settings.resume:
                    resumed(settings, run_settings(compose_here(choices)), [*choices, *job], choices)
            except ConfigError as err:
                raise type(err)(f"{err}{place}") from None


def job_place(job: list[str], args: list[str]) -> str:
    """` (in the job with stage=distill)` when `job` is one of several a sweep of config groups makes."""
    groups = [a for a in job if a not in args and group_options(a.split("=", 1)[0]) is not None]
    return f" (in the job with {' '.join(groups)})" if groups else ""


def check_output_folders(settings: RunSettings, args: list[str]) -> None:
    """The folders a job writes (paths.output_dir, hydra.run.dir / hydra.sweep.dir as given, resume) have no file
    in their way, found before Hydra makes them (its own error is a traceback)."""
    given = [(a.split("=", 1)[0].lstrip("+"), a.split("=", 1)[1]) for a in args if "=" in a]
    folders = [("paths.output_dir", settings.paths.output_dir)] + [(k, v) for k, v in given if k in OUTPUT_KEYS]
    for key, value in folders:
        literal = value.split("${", 1)[0].rstrip("/")  # the part before any interpolation (a date) is known now
        if not literal:
            continue
        blocker = in_the_way(Path(literal))
        if key == "resume" and blocker == Path(literal):
            raise ConfigError(f"resume={value!r} is a file; expected a run folder of `tcal`")
        if blocker is not None and (blocker != Path(literal) or "${" not in value or key == "resume"):
            raise ConfigError(f"{key}={value!r}: {blocker} is a file; expected a folder there")


# ------------------------------------------------------------------------------------------------ exits


def run_failed_exit(err: Exception, run_dir: Path) -> None:
    """A named failure of the run (divergence, a failed rank, a refused write): one line, exit code 1."""
    print(run_failed_line(err, run_dir), file=sys.stderr, flush=True)
    sys.exit(1)


def run_failed_line(err: Exception, run_dir: Path) -> str:
    """`tcal: run failed: <err> (<the record>)`: the record's path where it says `failed`, else what it is (none
    written, or one its failure could not be written to: a full disk)."""
    path = Path(run_dir) / RESULTS
    try:
        record = load_record(path) if path.is_file() else None
    except (RecordError, OSError) as unreadable:
        return f"tcal: run failed: {err} (the record {path} cannot be read: {unreadable})"
    if record is None:
        state = f"no record: {path} was not written"
    elif record.get("status") == "failed":
        state = f"record: {path}"
    else:
        state = f"the record {path} still says {record.get('status')!r}: its failure could not be written"
    return f"tcal: run failed: {err} ({state})"


def disk_full(err: BaseException) -> OSError | None:
    """The full disk (ENOSPC, or EDQUOT: the user's quota) behind a library's write that raised its own error, not
    tcal's WriteFailed (Lightning's metrics.csv, a lock file, Hydra's files); None for any other error."""
    from tcal.store.files import os_error_of

    refused = next(filter(None, (os_error_of(e) for e in (err, err.__cause__, err.__context__) if e)), None)
    return refused if refused is not None and refused.errno in (errno.ENOSPC, errno.EDQUOT) else None


def report_hydra_write_failures() -> None:
    """Hydra writes the job's log file and .hydra/*.yaml before the run starts, where a refused write (a full disk)
    would be its traceback: there it is `run_failed_exit`'s line too (before any record: none is written)."""
    from hydra.core import utils

    from tcal.store.files import write_failure

    def reported(write, target):
        def guarded(*args, **kwargs):
            try:
                return write(*args, **kwargs)
            except Exception as err:
                full = disk_full(err)
                if full is None:
                    raise
                path = target(full, *args)
                run_failed_exit(write_failure(path, full, kept=False), path.parent.parent if
                                path.parent.name == ".hydra" else path.parent)

        guarded.tcal_reported = True
        return guarded

    if not getattr(utils._save_config, "tcal_reported", False):  # (cfg, filename, output_dir): .hydra/<filename>
        utils._save_config = reported(utils._save_config, lambda refused, cfg, name, folder: Path(folder) / name)
    if not getattr(utils.configure_log, "tcal_reported", False):  # opens the job's log file
        utils.configure_log = reported(utils.configure_log, lambda refused, *args: Path(refused.filename or "."))


def interrupted_exit(err: Interrupted) -> None:
    """A signal stopped the run (or the sweep): one line each for it and any sweep job that did not run, exit code
    128 + the signal's number."""
    for line in interrupted_lines(err):
        print(f"tcal: {line}", file=sys.stderr, flush=True)
    sys.exit(err.exit_code)


# ------------------------------------------------------------------------------------------------ the entry


def default_settings(choices: list[str] | tuple[str, ...] = ()) -> RunSettings:
    """The settings `choices` alone compose (none: the defaults), in the running Hydra job."""
    from hydra import compose

    return run_settings(compose(config_name="config", overrides=list(choices)))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@handling
def hydra_main(cfg) -> None:
    from tcal.cli.rank import RankFailed
    run_dir = Path(cfg.resume or HydraConfig.get().runtime.output_dir)
    try:
        with sweep_job(cfg, run_dir):
            settings = run_settings(cfg)
            if settings.resume:
                settings = resumed(settings, default_settings(RESUME_CHOICES), list(HydraConfig.get().overrides.task),
                                   RESUME_CHOICES)
            run_in(settings, run_dir)
    except ConfigError as err:
        config_error_exit(err)
    except (Divergence, RankFailed, WriteFailed) as err:
        run_failed_exit(err, run_dir)
    except Exception as err:
        full = disk_full(err)
        if full is None:
            raise
        from tcal.store.files import write_failure

        where = full.filename or f"a file its error does not name (a library's write in the run {run_dir})"
        run_failed_exit(write_failure(where, full, kept=False), run_dir)
    except Interrupted as err:
        err.run_dir = getattr(err, "run_dir", run_dir)
        raise


def main() -> None:
    """The `tcal` console script."""
    args = sys.argv[1:]
    try:
        check_arguments(args)
        overrides = [a for a in args if not a.startswith("-")]
        if overrides == args and any(_key(a) == "resume" for a in args):  # one run (a sweep reads no run's options)
            with hydra_configs():
                RESUME_CHOICES[:] = run_choices(args, run_settings(compose_here([])))
    except ConfigError as err:
        config_error_exit(err)
    # the run's own options before the command's (a resume), the plugin packages' options (TCAL_PLUGINS) after
    sys.argv[1:] = [*RESUME_CHOICES, *args, *plugin_search_path()]
    report_hydra_write_failures()
    try:
        with handling():
            hydra_main()
    except Interrupted as err:
        interrupted_exit(err)
    if failed_jobs():
        sys.exit(1)


if __name__ == "__main__":
    main()
