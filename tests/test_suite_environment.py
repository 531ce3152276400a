"""The suite depends on nothing of the user's environment and touches nothing of theirs: started from another
folder, with $TCAL_CACHE_DIR naming the user's cache and W&B set online with a key, it passes and writes neither
into that cache nor into the folder it was started from (tests/conftest.py clears them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_suite_passes_and_touches_nothing_of_the_user_s(tmp_path):
    user_cache, elsewhere = tmp_path / "user_cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "TCAL_CACHE_DIR": str(user_cache), "WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(REPO / "tests" / "test_errors.py"), "-k", "bad_keep_lists or ratio_outside"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
    assert not user_cache.exists() and not any(elsewhere.iterdir())
