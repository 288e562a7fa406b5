"""Every `Note [name]` reference resolves to the file that defines it, and
every relative link and repository path in README.md and docs/ exists: the
checkers in tools/ run here, and each is shown to catch what it checks."""

import os
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTES = runpy.run_path(os.path.join(ROOT, "tools", "check_notes.py"))
LINKS = runpy.run_path(os.path.join(ROOT, "tools", "check_doc_links.py"))


def test_every_note_reference_resolves():
    assert NOTES["problems"](NOTES["tracked_texts"]()) == []


def test_a_dangling_or_misplaced_note_reference_is_caught():
    texts = {
        "a.h": "// Note [Defined here]\n// ~~~~~~~~~~~~~~~~~~~\n// text\n",
        "b.cpp": "// see Note [Defined here] in a.h, Note [Nowhere],\n// and Note [Defined\n// here] in b.cpp\n",
    }
    found = NOTES["problems"](texts)
    assert any("Note [Nowhere] is defined nowhere" in p for p in found), found
    assert any("is in a.h, not b.cpp" in p for p in found), found
    assert len(found) == 2, found


def test_every_link_and_path_in_the_docs_exists():
    pages = LINKS["pages"]()
    assert any(p.endswith("README.md") for p in pages)
    found = [f"{page}: {problem}" for page in pages for problem in LINKS["problems"](page)]
    assert found == []
