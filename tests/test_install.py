"""A non-editable install stands alone: the Hydra configs travel inside the package (`tcal/conf`, package data), so
`tcal experiment=smoke` runs from anywhere with nothing of the checkout on the path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir


def test_a_non_editable_install_runs_the_smoke_experiment(tmp_path):
    # Built from a copy of what the wheel is made of, so the build's own folders (build/, *.egg-info) stay out of the
    # checkout. conf/experiment and conf/sweep are links to experiments/ and sweeps/: copied as links, built as files.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    source.mkdir()
    shutil.copy2(REPO / "pyproject.toml", source / "pyproject.toml")
    shutil.copytree(REPO / "src", source / "src", symlinks=True, ignore=ignore)
    for folder in ("experiments", "sweeps"):
        shutil.copytree(REPO / folder, source / folder)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True, timeout=300)
    smoke = site / "tcal" / "conf" / "experiment" / "smoke.yaml"
    assert smoke.is_file() and not smoke.is_symlink() and not (site / "tcal" / "conf" / "experiment").is_symlink()

    # The install first on the path, ahead of the editable one in the venv; run from a folder outside the checkout.
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TCAL_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
    work = tmp_path / "work"
    work.mkdir()
    found = subprocess.run([sys.executable, "-c", "import tcal; print(tcal.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True)
    assert Path(found.stdout.strip()).is_relative_to(site), found.stdout
    done = subprocess.run([sys.executable, str(site / "bin" / "tcal"), "experiment=smoke", "hydra.run.dir=run"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((work / "run" / "results.json").read_text())["status"] == "complete"
