"""Command-line overrides checked before Hydra starts a job: each job of the command composes.

Hydra reports an override it cannot apply (a misspelled key, `+` on a key that exists, bad syntax) in several
lines and exits with code 1, and inside a sweep it stops the whole sweep; here it is one `ConfigError` naming
the argument, before any job runs. Keys added with `+` are checked once the job's config exists
(`tcal.validate.check_known_keys`). With `resume=RUN_DIR`, an override of a setting the recorded run holds is
compared with it here (the default config may not even have that key), as the job does (`tcal.rerun`).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from tcal.errors import ConfigError
from tcal.record import RESULTS, RecordError, load_record
from tcal.settings import CONF, GLOBAL_GROUPS, group_options, leaf_items, unknown_key_message

RUN_FLAGS = ("-m", "--multirun", "-r", "--run")  # flags that leave the overrides as they are


def parse(arg: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
    except HydraException as err:
        first = " ".join(str(err).split()).split(" See https://")[0]
        raise ConfigError(f"{arg}: cannot be read ({first}); expected key=value in Hydra's override syntax, e.g. "
                          f"retention.keep=[0,2]") from None
    return override


def job_override_lists(args: list[str]) -> list[list[str]]:
    """The override lists to compose for `args`: one per combination of swept config groups (a group decides
    which keys exist), other sweeps at their first value; Hydra's own settings left to Hydra."""
    from hydra.errors import HydraException

    fixed, swept = [], []
    for arg in args:
        override = parse(arg)
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if not override.is_sweep_override():
            fixed.append(arg)
            continue
        try:
            values = list(override.sweep_string_iterator())
        except HydraException:  # glob(...) needs Hydra's config loader: left to Hydra
            continue
        if group_options(key) is None:
            values = values[:1]
        swept.append([f"{override.get_key_element()}={value}" for value in values])
    return [fixed + list(combination) for combination in itertools.product(*swept)]


def job_place(job: list[str], args: list[str]) -> str:
    """` in the job with stage=distill` when `job` is one of several a sweep of config groups makes."""
    groups = [a for a in job if a not in args and group_options(a.split("=", 1)[0]) is not None]
    return f" in the job with {' '.join(groups)}" if groups else ""


def one_line(err: Exception, job: list[str], args: list[str]) -> str:
    """Hydra's composition error as one line naming the argument (a value of the wrong type: the schema's message)."""
    from omegaconf.errors import ValidationError

    message = " ".join(str(err).split())
    by_key = {a.lstrip("+~").split("=", 1)[0]: a for a in job}
    where = job_place(job, args)
    if found := re.match(r"Could not override '([^']+)'", message):
        key = found.group(1)
        return unknown_key_message(by_key.get(key, key), key, where=where)
    if found := re.match(r"Could not append to config. An item is already at '([^']+)'", message):
        key = found.group(1)
        return f"{by_key.get(key, key)}: {key} is already a setting; expected {by_key.get(key, key).lstrip('+')}"
    cause = err.__cause__
    if isinstance(cause, ValidationError) and cause.full_key:
        arg = by_key.get(cause.full_key.split("[")[0], cause.full_key)  # `retention.keep[1]`: the list's argument
        return (f"{arg}: {str(cause).splitlines()[0].strip()} (key {cause.full_key}); expected a value of the type "
                f"its schema declares")
    if found := re.match(r"Could not delete from config. '([^']+)' does not exist", message):
        key = found.group(1)
        return f"{by_key.get(key, key)}: no such setting to delete{where}; expected a setting of the config (conf/)"
    return f"{' '.join(job)}: {message}; expected overrides that compose"


def check_overridden_keys(cfg, job: list[str], args: list[str]) -> None:
    """`key=value` names a setting of the job's config (schemas let Hydra set any key; `+key=value` is checked
    once the job runs, with every other key of its config)."""
    from tcal.settings import is_known, known_keys

    known = known_keys(cfg)
    for arg in job:
        override = parse(arg)
        key = override.key_or_group
        plain_setting = not override.is_add() and not override.is_delete() and not override.is_force_add()
        if plain_setting and group_options(key) is None and not is_known(key, known):
            raise ConfigError(unknown_key_message(arg, key, known, where=job_place(job, args)))


def check_true_or_false(cfg, job: list[str]) -> None:
    """A true/false setting is given as true or false: the schema would also take yes, on or 1 as true."""
    from omegaconf import OmegaConf

    for arg in job:
        override = parse(arg)
        if override.is_delete() or group_options(override.key_or_group) is not None:
            continue
        value = OmegaConf.select(cfg, override.key_or_group, default=None)
        if isinstance(value, bool) and not isinstance(override.value(), bool):
            raise ConfigError(f"{arg}; expected true or false")


def check_resume_overrides(run_dir: str, overrides: list[str]) -> None:
    """The overrides of `tcal resume=RUN_DIR ...` change no setting of the recorded run but safe ones."""
    from tcal.errors import FolderInUse
    from tcal.rerun import SAFE_ON_RESUME, describe, differing_keys

    try:
        recorded = load_record(Path(run_dir) / RESULTS).get("config")
    except RecordError:
        return  # the job names the problem
    if recorded is None:
        return
    given = {}
    for arg in overrides:
        override = parse(arg)
        key = override.key_or_group
        skipped = key in ("resume", *GLOBAL_GROUPS) or key.startswith("hydra")
        if skipped or override.is_delete() or override.is_sweep_override():
            continue
        dotted = key.replace("/", ".")
        given[f"{dotted}.name" if group_options(key) is not None else dotted] = override.value()
    known = leaf_items(recorded)
    differences = differing_keys({k: known.get(k) for k in given}, given)
    if differences:
        raise FolderInUse(f"resume={run_dir}: the run was started with other settings ({describe(differences)}); "
                          f"expected only keys safe to change on resume ({', '.join(SAFE_ON_RESUME)})")


def check_arguments(args: list[str]) -> None:
    """Every job that `args` describe composes; raises ConfigError with one line otherwise."""
    if any(a.startswith("-") and a not in RUN_FLAGS for a in args):
        return  # --cfg, --info, -cn ...: Hydra's own modes
    overrides = [a for a in args if a not in RUN_FLAGS]
    if not any(a in ("-m", "--multirun") for a in args):
        for arg in overrides:
            if parse(arg).is_sweep_override():
                raise ConfigError(f"{arg}: a sweep of values in a single run; expected tcal -m ... to run one job "
                                  f"per value, or {arg.split('=', 1)[0]}=[...] for a list")
    jobs = job_override_lists(overrides)
    resume = next((a.split("=", 1)[1] for a in overrides if a.startswith("resume=")), None)
    if resume:
        check_resume_overrides(resume, overrides)
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            for job in jobs:
                try:
                    cfg = compose("config", overrides=job)
                except (HydraException, OmegaConfBaseException) as err:
                    raise ConfigError(one_line(err, job, overrides)) from None
                check_overridden_keys(cfg, job, overrides)
                check_true_or_false(cfg, job)
                check_output_folders(cfg, overrides)
    finally:
        GlobalHydra.instance().clear()


OUTPUT_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "resume")


def check_output_folders(cfg, args: list[str]) -> None:
    """The folders a job writes (paths.output_dir, hydra.run.dir / hydra.sweep.dir as given, resume) have no file
    in their way, found before Hydra makes them (its own error is a traceback)."""
    from tcal.results import in_the_way

    given = [(a.split("=", 1)[0].lstrip("+"), a.split("=", 1)[1]) for a in args if "=" in a]
    folders = [("paths.output_dir", str(cfg.paths.output_dir))] + [(k, v) for k, v in given if k in OUTPUT_KEYS]
    for key, value in folders:
        literal = value.split("${", 1)[0]  # the part before any interpolation (a date) is known now
        if not literal:
            continue
        blocker = in_the_way(Path(literal)) if not literal.endswith("/") else in_the_way(Path(literal.rstrip("/")))
        if key == "resume" and blocker == Path(literal):
            raise ConfigError(f"resume={value!r} is a file; expected a run folder of `tcal`")
        if blocker is not None and (blocker != Path(literal) or "${" not in value or key == "resume"):
            raise ConfigError(f"{key}={value!r}: {blocker} is a file; expected a folder there")
