"""What the Hugging Face hub can give a run: whether it is offline or reachable, whether a name means a local path
or a hub id, whether a hub model or dataset is already in the local cache, and an offline block for the libraries
that read their offline flags only at import."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def flag_set(name: str) -> bool:
    """An environment flag as huggingface_hub reads it: unset, empty, 0, false and no are off."""
    return os.environ.get(name, "0").lower() not in ("0", "", "false", "no")


def hub_offline(datasets: bool = False) -> bool:
    """HF_HUB_OFFLINE set (in the environment, or as huggingface_hub read it at import); with `datasets`,
    HF_DATASETS_OFFLINE counts too."""
    import huggingface_hub.constants

    names = OFFLINE_FLAGS if datasets else OFFLINE_FLAGS[:1]
    return any(flag_set(name) for name in names) or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float) -> bool:
    """Online, and the hub's endpoint accepts a connection within `timeout` seconds."""
    import huggingface_hub.constants as hub_constants

    if hub_offline():
        return False
    url = urlparse(hub_constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def looks_local(path: str) -> bool:
    """Hub ids are `org/name`; anything rooted or deeper is meant as a folder."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1


def hub_model_cached(repo_id: str) -> bool:
    """The hub model `repo_id` has its config.json in the local hub cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def datasets_cache_dir() -> Path:
    """Where `datasets` keeps what it downloaded (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    return Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()


def hub_dataset_cached(name: str) -> bool:
    """The hub dataset `name` (`org/name`) has a folder in the datasets cache."""
    return (datasets_cache_dir() / name.replace("/", "___")).is_dir()


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """Offline flags for `datasets`/`huggingface_hub`, which read the environment only at import; restored after."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in OFFLINE_FLAGS}
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    os.environ.update({k: "1" for k in OFFLINE_FLAGS})
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
