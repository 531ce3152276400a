"""README and docs/ stand alone: every relative link and image resolves, every `#anchor` names a heading, and every
section a citation names ("docs/method.md, section "Init modes"", "[results.md](results.md), "Retention 0.25"")
is a heading of that file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = [*DOCS, *(p for d in ("src", "tests", "experiments", "sweeps", "benchmarks")
                   for p in sorted((ROOT / d).rglob("*"))
                   if p.suffix in {".py", ".yaml", ".md"} and p != Path(__file__).resolve())]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# a file named by path or by link, then its sections in quotes: `docs/method.md, sections "A" and "B"`
CITATION = re.compile(r"(?:\[[\w.]+\]\()?((?:docs/)?[\w-]+\.md)\)?,?\s+(?:sections?\s+)?((?:\"[^\"\n]+\"(?:,\s*|\s+and\s+)?)+)")


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.M)]


def anchors(path: Path) -> set[str]:
    """GitHub's anchor of every heading, and every explicit `<a id="...">`."""
    text = path.read_text()
    made = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings(path)}
    return made | set(re.findall(r"<a id=\"([^\"]+)\"", text))


def names_heading(path: Path, name: str) -> bool:
    """A citation names a heading by its text, without its leading number ("7.6 full_plus" is cited as
    "full_plus") and optionally without what follows (a parenthesis or a colon)."""
    for heading in headings(path):
        text = re.sub(r"^[\d.]+\s+", "", heading)
        if text == name or re.match(re.escape(name) + r"\s*[(:]", text):
            return True
    return False


def cited_file(source: Path, name: str) -> Path:
    for candidate in (source.parent / name, ROOT / name, ROOT / "docs" / name):
        if candidate.is_file():
            return candidate
    raise AssertionError(f"{source.relative_to(ROOT)} cites {name}, which does not exist")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part) if file_part else doc
        if not path.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


def test_cited_sections_exist():
    missing = []
    for source in CITING:
        text = source.read_text()
        for match in CITATION.finditer(text):
            names = re.findall(r"\"([^\"]+)\"", match.group(2))
            target = cited_file(source, match.group(1))
            missing += [f"{source.relative_to(ROOT)} -> {match.group(1)}, \"{n}\"" for n in names
                        if not names_heading(target, n)]
    assert not missing, "cited sections that are not headings:\n" + "\n".join(missing)
