"""`tcal`: the Hydra entry of the main job (see conf/config.yaml)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from tcal.pipeline import run

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
