"""Checks that every `Note [name]` reference resolves: a Note of that name is
defined (its name on a line of its own, underlined with ~~~, or opening a
docstring or comment block), and where the reference names a file (`Note
[name] in path`), the Note is defined in that file. Exits 1 and lists the
problems otherwise. Run from anywhere: python tools/check_notes.py"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".h", ".cpp", ".py", ".md", ".sh")
# This checker and its test write about Notes rather than refer to them.
ABOUT_NOTES = ("tools/check_notes.py", "tests/docs/test_notes_and_links.py")
UNDERLINED = re.compile(r"^[ \t]*(?://|#)?[ \t]*Note \[([^\]\n]+)\][ \t]*\n[ \t]*(?://|#)?[ \t]*~+", re.M)
OPENING = re.compile(r'^[ \t]*(?:"""|#[ \t]*)?Note \[([^\]\n]+)\][ \t]*$', re.M)
REFERENCE = re.compile(r"Note\s+\[([^\]]+)\](?:[\s/#]+in[\s/#]+`?([\w/.]+\.(?:h|cpp|py)))?")


def normalized(name: str) -> str:
    return " ".join(re.sub(r"//|#", " ", name).split())


def source_names() -> list:
    """The files git tracks; in a copy without git (a build folder), every
    file below the root except build output and hidden folders."""
    try:
        return subprocess.check_output(["git", "ls-files"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).split()
    except (OSError, subprocess.CalledProcessError):
        names = []
        for folder, subfolders, files in os.walk(ROOT):
            subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("build", "__pycache__")]
            names += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
        return names


def tracked_texts() -> dict:
    texts = {}
    for name in source_names():
        path = os.path.join(ROOT, name)
        if name.endswith(SUFFIXES) and name not in ABOUT_NOTES and not name.startswith("benchmarks/results/") \
                and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                texts[name] = f.read()
    return texts


def problems(texts: dict) -> list:
    defined = {}
    for name, text in texts.items():
        for pattern in (UNDERLINED, OPENING):
            for match in pattern.finditer(text):
                defined.setdefault(normalized(match.group(1)), set()).add(name)
    found = []
    for name, text in texts.items():
        for match in REFERENCE.finditer(text):
            note, path = normalized(match.group(1)), match.group(2)
            if note not in defined:
                found.append(f"{name}: Note [{note}] is defined nowhere")
            elif path and path not in defined[note]:
                found.append(f"{name}: Note [{note}] is in {', '.join(sorted(defined[note]))}, not {path}")
    return found


def main() -> int:
    found = problems(tracked_texts())
    for problem in found:
        print(problem)
    print(f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
