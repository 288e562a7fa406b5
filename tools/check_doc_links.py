"""Checks the README and every page under docs/: every relative link resolves to a file
(and its #anchor to a heading there), and every repository path written in
backticks (`reducer/observation/timeline.h`, `tests/support/spawn.py`) exists.

    python tools/check_doc_links.py      # prints what is broken; exit status 1 if anything is
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_FOLDERS = ("bindings", "reducer", "comm_hooks", "process_groups", "ddp_ext", "benchmarks", "tests", "tools",
               "examples", "docs", ".ci")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def problems(page: str):
    with open(page) as f:
        text = f.read()
    here = os.path.dirname(page)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(here, file_part)) if file_part else page
        if not os.path.exists(path):
            yield f"link to a missing file: {target}"
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            yield f"link to a missing heading: {target}"
    for token in CODE.findall(FENCE.sub("", text)):
        token = token.rstrip(".,:;")
        first = token.split("/")[0]
        if "/" in token and first in TOP_FOLDERS and not any(c in token for c in "*{<"):
            if not os.path.exists(os.path.join(ROOT, token)):
                yield f"path that does not exist: {token}"


def pages() -> list:
    """README.md and every page under docs/, its subfolders included."""
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def main() -> int:
    checked = pages()
    broken = 0
    for page in checked:
        for problem in problems(page):
            print(f"{os.path.relpath(page, ROOT)}: {problem}")
            broken += 1
    print(f"{len(checked)} pages checked, {broken} problem(s)")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
