"""The semantics document lives in the repository and every ``semantics §N`` reference points into it."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "semantics.md"
_REF = re.compile(r"semantics\s*§\s*(\d+)")


def _sources() -> list[pathlib.Path]:
    files = [ROOT / "README.md"]
    for folder in ("src", "tests", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    return files


def _sections() -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", DOC.read_text(), re.M))


def test_document_has_every_numbered_section():
    assert _sections() == {str(i) for i in range(10)}


def test_every_reference_points_to_an_existing_section():
    sections = _sections()
    refs = {}
    for path in _sources():
        for m in _REF.finditer(path.read_text(errors="replace")):
            refs.setdefault(m.group(1), []).append(path.relative_to(ROOT).as_posix())
    assert refs, "the code refers to the semantics document"
    missing = {sec: where for sec, where in refs.items() if sec not in sections}
    assert not missing, f"references to sections that do not exist: {missing}"


def test_no_reference_leaves_the_repository():
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in _sources()
        if re.search(r"shared/SPEC|SPEC\.md", p.read_text(errors="replace")) and p.name != "test_semantics_doc.py"
    ]
    assert not offenders
