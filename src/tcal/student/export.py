"""The student as a Hugging Face checkpoint: `save_pretrained` of the model (the hybrid's own config and weights,
loadable with `AutoModelForCausalLM` once `tcal.student.hybrid` is imported) and of its tokenizer, written whole or
not at all (`tcal.store.files.write_folder_atomic`)."""

from __future__ import annotations

from pathlib import Path

from tcal.store.files import write_folder_atomic


def export_student(student, tokenizer, folder: Path) -> Path:
    """Write `student` and `tokenizer` into `folder`: a new or empty folder, or an earlier export of tcal (its
    manifest lists every file there); a folder holding anything else is refused, naming it, and nothing is deleted."""

    def write(tmp: Path) -> None:
        student.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_folder_atomic(Path(folder), write)
    return Path(folder)
