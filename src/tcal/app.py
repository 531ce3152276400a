"""`tcal`: the Hydra entry of the main job (see conf/config.yaml).

Run again into a folder that already holds a run of the same config (`hydra.sweep.dir=` of a finished or
interrupted sweep), a finished run is skipped and an unfinished one continues from its last checkpoint, so a
rerun of a sweep does no work twice.

A configuration error (`tcal.errors.ConfigError`: a bad setting, unreadable data, or an unknown option of a
config group) prints one line on stderr and exits with code 2, before any work and without a traceback.
"""

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tcal.arguments import check_arguments
from tcal.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
CONFIG_ERROR_EXIT = 2


def resumed_config(run_dir: Path):
    """The resolved config a run recorded in its results.json, to continue that run exactly."""
    results = Path(run_dir) / "results.json"
    if not results.is_file():
        raise ConfigError(f"resume={str(run_dir)!r}: no results.json there; expected a run folder of `tcal`")
    cfg = OmegaConf.create(json.loads(results.read_text())["config"])
    cfg.resume = str(run_dir)
    return cfg


def _json_object(data):
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def earlier_run(cfg, run_dir: Path) -> str:
    """What `run_dir` holds for `cfg`: "none" (nothing, or a run of another config), "complete" or "unfinished".
    A damaged results.json is warned about and run again."""
    from tcal.cache_entry import read_json  # imports torch: not before a config error could stop the job
    data = read_json(Path(run_dir) / "results.json", "results of an earlier run", _json_object)
    if data is None or data.get("config") != OmegaConf.to_container(cfg, resolve=True):
        return "none"
    return "complete" if data.get("status") == "complete" else "unfinished"


def run_in(cfg, run_dir: Path) -> None:
    """Run `cfg` in `run_dir`: skip it when already complete there, continue it when unfinished."""
    from tcal.pipeline import run
    earlier = earlier_run(cfg, run_dir)
    if earlier == "complete":
        print(f"tcal: {run_dir} already holds this run, complete; nothing to do "
              f"(results: {Path(run_dir) / 'results.json'})", flush=True)
        return
    if earlier == "unfinished":
        print(f"tcal: {run_dir} holds this run, unfinished; continuing it", flush=True)
    run(cfg, run_dir, resume=earlier == "unfinished")


def group_options(group: str) -> list[str] | None:
    """The options of config group `group` (a folder of conf/), or None when `group` is not a group."""
    folder = Path(CONF_DIR) / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else None


def check_group_overrides(args: list[str]) -> None:
    """`group=option` arguments name existing options (Hydra's own message spans many lines)."""
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~").split("@")[0]
        options = group_options(key) if sep and not key.startswith("hydra") else None
        if options is None or value in ("", "null") or "(" in value:
            continue  # not a group, a deletion, or a sweep function such as glob(...)
        for option in value.strip("[]").split(","):
            if option not in options:
                raise ConfigError(f"{key}={option!r}: no such option in config group {key!r}; "
                                  f"expected one of {', '.join(options)}")


def config_error_exit(err: Exception) -> None:
    print(f"tcal: configuration error: {err}", file=sys.stderr, flush=True)
    sys.exit(CONFIG_ERROR_EXIT)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg) -> None:
    from tcal.pipeline import run
    try:
        if cfg.get("resume"):
            run(resumed_config(Path(cfg.resume)), Path(cfg.resume), resume=True)
        else:
            run_in(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        config_error_exit(err)


def main() -> None:
    """The `tcal` console script."""
    try:
        check_group_overrides(sys.argv[1:])
        check_arguments(sys.argv[1:])
    except ConfigError as err:
        config_error_exit(err)
    hydra_main()


if __name__ == "__main__":
    main()
