"""`tcal`: the Hydra entry of the main job (see conf/config.yaml)."""

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tcal.pipeline import run

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def resumed_config(run_dir: Path):
    """The resolved config a run recorded in its results.json, to continue that run exactly."""
    results = Path(run_dir) / "results.json"
    if not results.is_file():
        raise FileNotFoundError(f"resume={str(run_dir)!r}: no results.json there; expected a run folder of `tcal`")
    cfg = OmegaConf.create(json.loads(results.read_text())["config"])
    cfg.resume = str(run_dir)
    return cfg


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg) -> None:
    if cfg.get("resume"):
        run(resumed_config(Path(cfg.resume)), Path(cfg.resume), resume=True)
    else:
        run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
