"""An export loads as the docs say: what DEST's configs name is in DEST, and what a user loads from DEST (the model,
its tokenizer, its generation defaults and chat template) is what SOURCE held.

`carry_or_drop` runs on the written export, before its check: the files SOURCE holds beside the student that a
loader reads without being told (`COMPANIONS`: the generation defaults, chat template files) are carried, SOURCE's
in place of any the format wrote (a format that builds another model, `qwen3_5`, writes that model's defaults); then every file DEST's JSON configs name (`named_files`: an `auto_map` entry's module, a
`*_file` key such as `tokenizer_file`) that is not in DEST is carried from SOURCE when it is a data file there, or its
pointer is dropped. Code is never carried: a module an `auto_map` names that the format did not write is SOURCE's
code, which the export's check does not run (a SOURCE's remote code never runs here) and a user of DEST with
`trust_remote_code=True` would; its pointer is dropped (the tokenizer class the export loaded, a stock one, stays
named in `tokenizer_class`). `loads_as_source` then loads DEST's tokenizer and generation defaults as the format's
users load them and compares them with SOURCE's.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from tcal.export.refusal import ParityFailed
from tcal.export.parity import PARITY_TEXTS

log = logging.getLogger(__name__)

COMPANIONS = ("generation_config.json", "chat_template.jinja", "chat_template.json", "additional_chat_templates")


def named_files(folder: Path) -> list[tuple[str, tuple, str]]:
    """(config file, key path, file named) for each file a JSON config in `folder` names: every module of an
    `auto_map` (`module.Class`, also in a [slow, fast] pair; `repo--module.Class` names another repository's) and
    every string under a key ending in `_file`."""
    found = []
    for config in sorted(folder.glob("*.json")):
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for key, value in data.items():
            if key == "auto_map" and isinstance(value, dict):
                for auto_class, targets in value.items():
                    for target in targets if isinstance(targets, list) else [targets]:
                        if isinstance(target, str):
                            found.append((config.name, ("auto_map", auto_class), f"{target.rpartition('.')[0]}.py"))
            elif key.endswith("_file") and isinstance(value, str) and value:
                found.append((config.name, (key,), value))
    return found


def carry_or_drop(source: Path, folder: Path) -> dict:
    """Make `folder` (the written export) hold what its configs name, from SOURCE's student folder `source`; returns
    the record entry: what was carried and which pointers were dropped, and why."""
    carried, dropped = [], []
    for name in COMPANIONS:
        if (source / name).exists() and not (source / name).is_symlink():
            copy(source / name, folder / name)
            carried.append(name)
    for config, keys, name in named_files(folder):
        if holds(folder, name):
            continue
        code = keys[0] == "auto_map"
        origin = source / name
        if not code and holds(source, name) and not origin.is_symlink():
            copy(origin, folder / name)
            carried.append(name)
            continue
        why = ("SOURCE's code: never carried, never run" if code else
               "not a file inside SOURCE" if origin.exists() else "not in SOURCE")
        drop_pointer(folder / config, keys, name)
        dropped.append({"config": config, "key": ".".join(keys), "names": name, "why": why})
        log.info("export: %s %s named %s (%s): pointer dropped", config, ".".join(keys), name, why)
    return {"carried": sorted(set(carried)), "dropped": dropped}


def holds(folder: Path, name: str) -> bool:
    """Whether `name` (as a config names it) is a file inside `folder`: not an absolute path, nor one that leaves
    the folder (`../`, a link out of it)."""
    path, root = (folder / name).resolve(), folder.resolve()
    return root in path.parents and path.is_file()


def copy(origin: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if origin.is_dir():
        shutil.copytree(origin, target, dirs_exist_ok=True, ignore=lambda parent, names: [
            name for name in names if (Path(parent) / name).is_symlink()])
    else:
        shutil.copyfile(origin, target)


def drop_pointer(config_path: Path, keys: tuple, name: str) -> None:
    """Remove the entry of `keys` naming `name` from the JSON config at `config_path` (an `auto_map` emptied by it
    goes too)."""
    data = json.loads(config_path.read_text(encoding="utf-8"))
    if keys[0] == "auto_map":
        auto_map = data["auto_map"]
        auto_map.pop(keys[1], None)
        if not auto_map:
            data.pop("auto_map")
    else:
        data.pop(keys[0], None)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def loads_as_source(folder: Path, source: Path, tokenizer, trust_remote_code: bool) -> dict:
    """DEST (`folder`) loaded as the format's users load it, against SOURCE: every file its configs name is there,
    its tokenizer (AutoTokenizer, `trust_remote_code` as the format's users pass it) gives SOURCE's tokenizer's ids on
    the parity texts and its chat template, and its generation defaults are SOURCE's. ParityFailed naming what
    differs; the record entry otherwise."""
    from transformers import AutoTokenizer, GenerationConfig

    missing = [f"{config} {'.'.join(keys)} names {name}" for config, keys, name in named_files(folder)
               if not holds(folder, name)]
    if missing:
        raise ParityFailed(f"the export's configs name files it does not hold: {'; '.join(missing)}")
    checked = []
    if tokenizer is not None:
        try:
            loaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except Exception as err:  # noqa: BLE001 - any failure: a user cannot load the tokenizer
            raise ParityFailed(f"the export's tokenizer does not load ({type(err).__name__}: "
                               f"{' '.join(str(err).split())[:200]})") from None
        for text in PARITY_TEXTS:
            if loaded(text)["input_ids"] != tokenizer(text)["input_ids"]:
                raise ParityFailed(f"the export's tokenizer ({type(loaded).__name__}) gives other ids than SOURCE's "
                                   f"on {text[:40]!r}")
        if getattr(loaded, "chat_template", None) != getattr(tokenizer, "chat_template", None):
            raise ParityFailed("the export's tokenizer has another chat template than SOURCE's")
        checked += ["tokenizer", "chat_template"]
    if (source / "generation_config.json").is_file():
        try:
            theirs, ours = (GenerationConfig.from_pretrained(where).to_diff_dict() for where in (source, folder))
        except Exception as err:  # noqa: BLE001 - any failure: a user cannot load the generation defaults
            raise ParityFailed(f"the generation defaults do not load ({type(err).__name__}: "
                               f"{' '.join(str(err).split())[:200]})") from None
        for config in (theirs, ours):
            config.pop("transformers_version", None)
        if theirs != ours:
            raise ParityFailed(f"the export's generation defaults differ from SOURCE's ({ours} against {theirs})")
        checked.append("generation_config")
    return {"checked": checked}
