"""The student as a Hugging Face checkpoint: `save_pretrained` of the model (the hybrid's own config and weights,
loadable with `AutoModelForCausalLM` once `tcal.student.hybrid` is imported) and of its tokenizer, written whole or
not at all (`tcal.store.files.write_folder_atomic`). The other formats (`tcal-export`, `tcal.export`) start from the
same files (`write_student`)."""

from __future__ import annotations

from pathlib import Path

from tcal.store.files import write_folder_atomic


def write_student(student, tokenizer, folder: Path) -> None:
    """`save_pretrained` of `student` and, when there is one, `tokenizer` into `folder` (no atomicity: the caller's
    temporary folder)."""
    student.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def export_student(student, tokenizer, folder: Path) -> Path:
    """Write `student` and `tokenizer` into `folder`: a new or empty folder, or an earlier export of tcal (its
    manifest lists every file there); a folder holding anything else is refused, naming it, and nothing is deleted."""
    write_folder_atomic(Path(folder), lambda tmp: write_student(student, tokenizer, tmp))
    return Path(folder)
