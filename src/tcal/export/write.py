"""One export: load the student, write the format into a temporary sibling of the destination, carry what its configs
name (`tcal.export.companions`), reload what was written, check it against the student (`tcal.export.parity`) and
its tokenizer and generation defaults against SOURCE's, record the check in `EXPORT_RECORD`, and only then
move the folder into place (`tcal.store.files.write_folder_atomic`: a failed check, a refusal or a crash leaves the
destination as it was).

What a format writes and how it is reloaded is the format's own (`tcal.export.formats`, an `ExportFormat` per name
in `tcal.registry.EXPORT_FORMATS`). The reload runs in this process, in float32, with the loader a user of the
format has: `AutoModelForCausalLM` with tcal imported (`tcal`, `vllm`: the plugin reads the same config and weights),
with `trust_remote_code=True` and the shipped modeling file (`hf`), or stock transformers (`qwen3_5`). For `vllm`, a
vLLM interpreter (`serve_python`) adds the engine's own check under the bfloat16 rule; without one the record says
the engine was not checked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tcal.export.parity import LOGIT_TOLERANCE, parity_prompts
from tcal.export.refusal import ExportRefused, ParityFailed
from tcal.registry import EXPORT_FORMATS
from tcal.store.files import check_folder_target, check_writable, listed_files, through_links, write_folder_atomic
from tcal.store.record import RESULTS

log = logging.getLogger(__name__)

EXPORT_RECORD = "tcal_export.json"  # in every export: format, source, parity (and the engine check for vllm)
RUN_CONTENTS = ("student", "checkpoints", "logs", ".hydra", RESULTS)  # what a run folder holds of its own


def student_folder(source: Path) -> Path:
    """SOURCE as the folder holding the student: itself, or a run folder's `student/`."""
    source = Path(source)
    for folder in (source, source / "student"):
        if (folder / "config.json").is_file():
            return folder
    raise ExportRefused(f"{source}: no student there (expected a student folder with config.json, or a run folder "
                        f"with student/)")


def check_destination(source: Path, student: Path, dest: Path) -> None:
    """DEST is none of what an export must leave alone, refused before any work: its source (SOURCE as given and the
    student folder it reads, a folder inside either or above them), a run folder or what a run holds of its own
    (`RUN_CONTENTS`: its student, checkpoints, logs, record), or a folder tcal wrote that is not an earlier export
    (a student `tcal` or `api.save` saved). An earlier export, an empty or a new folder is written."""
    where = through_links(dest).resolve()  # a link that loops: refused here, in one line
    for kept, what in ((student.resolve(), "the student it exports"), (source.resolve(), "SOURCE")):
        if where == kept or kept in where.parents or where in kept.parents:
            relation = "is" if where == kept else "is inside" if kept in where.parents else "holds"
            raise ExportRefused(f"{dest} {relation} {what} ({kept}): an export never writes into its source; "
                                f"expected a DEST outside it")
    for folder in (where, *where.parents):
        if not (folder / RESULTS).is_file():
            continue
        inside = where.relative_to(folder).parts
        if not inside or inside[0] in RUN_CONTENTS:
            part = f"the run folder {folder}" if not inside else f"{folder / inside[0]}, a part of the run {folder}"
            raise ExportRefused(f"{dest} is {part}: an export never writes into a run's student, checkpoints, logs "
                                f"or record; expected a DEST outside them")
    listed = listed_files(dest) if dest.is_dir() else None
    if listed and EXPORT_RECORD not in listed:
        raise ExportRefused(f"{dest} holds a student tcal saved (no {EXPORT_RECORD}: not an earlier tcal-export); "
                            f"refusing to replace it: expected a new or empty folder, or an earlier export")


def student_config(folder: Path):
    """The student's `HybridConfig`, read without its weights (refusals come before any loading)."""
    import tcal.student.hybrid  # noqa: F401  (registers model_type tcal_hybrid)
    from transformers import AutoConfig

    config_file = folder / "config.json"
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ExportRefused(f"{config_file} cannot be read ({type(err).__name__}: {one_line(err)}); expected the "
                            f"config.json of a student tcal saved") from None
    if model_type != "tcal_hybrid":
        raise ExportRefused(f"{folder}: model_type {model_type!r} is not a tcal student (expected 'tcal_hybrid')")
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - any failure: the file is not a student's config
        raise ExportRefused(f"{config_file} is not a student's config ({type(err).__name__}: {one_line(err)}); "
                            f"expected the config.json of a student tcal saved") from None


def load_student(folder: Path):
    """(student in float32 eval mode, tokenizer or None) from a folder tcal wrote; ExportRefused naming the file that
    cannot be read (a damaged or missing model.safetensors, a broken tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        student = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except Exception as err:  # noqa: BLE001 - whatever fails, the weights are not a whole student's
        raise ExportRefused(f"{damaged_weights(folder) or folder}: the student's weights cannot be read "
                            f"({type(err).__name__}: {one_line(err)}); expected a whole student folder as tcal "
                            f"saved it (restore it, or save the student again)") from None
    if not (folder / "tokenizer_config.json").is_file():
        return student, None
    try:
        return student, AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001
        raise ExportRefused(f"{folder}: the student's tokenizer cannot be read ({type(err).__name__}: "
                            f"{one_line(err)}); expected the tokenizer files tcal saved beside it") from None


def damaged_weights(folder: Path) -> Path | None:
    """The first weight file of `folder` whose safetensors header cannot be read (None: all can, or none is there)."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    handle.get_slice(key)
        except Exception:  # noqa: BLE001
            return path
    return None


def one_line(err: BaseException, limit: int = 200) -> str:
    return " ".join(str(err).split())[:limit]


def check_format(config, fmt: str, options: dict | None = None):
    """The `ExportFormat` named `fmt`, configured with `options` (e.g. {"outtype": "q8_0"}), once it found it can hold
    the student of `config` exactly (refused before any work otherwise, as is an option the format does not take)."""
    if fmt not in EXPORT_FORMATS:
        raise ExportRefused(f"--format {fmt!r}; expected one of {', '.join(EXPORT_FORMATS.names())}")
    export_format = EXPORT_FORMATS[fmt].implementation
    for name in options or {}:
        if name not in export_format.options:
            takes = ", ".join(f"--{option}" for option in export_format.options) or "none"
            raise ExportRefused(f"--{name} is not an option of --format {fmt} (its options: {takes})")
    export_format = export_format.configured(**(options or {}))
    export_format.check(config)
    return export_format


def export(source: Path, dest: Path, fmt: str, tolerance: float = LOGIT_TOLERANCE,
           serve_python: Path | None = None, options: dict | None = None) -> dict:
    """Write SOURCE's student into DEST in format `fmt` (with the format's `options`), or raise ExportRefused /
    ParityFailed with DEST untouched. Returns the record written as DEST/EXPORT_RECORD."""
    folder = student_folder(Path(source))
    check_destination(Path(source), folder, Path(dest))
    check_folder_target(dest)
    check_writable(dest)
    export_format = check_format(student_config(folder), fmt, options)
    student, tokenizer = load_student(folder)
    prompts = parity_prompts(tokenizer, student.config.vocab_size)
    record: dict = {"format": fmt, "source": str(folder.resolve()), "written_by": "tcal-export"}

    def write(tmp: Path) -> None:
        export_format.write(student, tokenizer, tmp)
        record["companions"] = export_format.carry(folder, tmp)
        parity, entries = export_format.check_written(student, tmp, prompts, tolerance)
        record.update(entries)
        record["parity"] = parity.record()
        log.info("%s export parity: %s", fmt, parity.summary())
        if not parity.passed:
            raise ParityFailed(f"--format {fmt}: the written export does not reproduce the student ({parity.summary()}); "
                               f"nothing written to {dest}")
        record["loads"] = export_format.loads(tmp, folder, tokenizer)
        record.update(export_format.after_parity(student, tmp, prompts, serve_python))
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    write_folder_atomic(Path(dest), write)
    return record
