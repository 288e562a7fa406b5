"""docs/ARCHITECTURE.md lists which file each of the C++ Reducer's methods
lives in; this keeps the list true to the sources."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFINITION = re.compile(r"^(?:[\w:<>,*&]+[ \t]+)*Reducer::(~?\w+)\(", re.M)


def _defined():
    """{file: {method}} from the definitions in reducer/**/*.cpp."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "reducer", "**", "*.cpp"), recursive=True)):
        with open(path) as f:
            names = set(DEFINITION.findall(f.read()))
        if names:
            found[os.path.relpath(path, ROOT)] = names
    return found


def _listed():
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")) as f:
        text = f.read()
    section = text.split("## The reducer's methods, by file", 1)[1].split("\n## ", 1)[0]
    listed = {}
    for row in re.findall(r"^\| `(reducer/[\w/]+\.cpp)` \| (.*) \|$", section, flags=re.M):
        listed[row[0]] = set(re.findall(r"`(~?\w+)`", row[1]))
    return listed


def test_every_reducer_method_is_listed_in_its_file():
    defined, listed = _defined(), _listed()
    assert defined, "no Reducer method found in reducer/**/*.cpp"
    assert set(listed) == set(defined), f"files listed {sorted(listed)}, files defining methods {sorted(defined)}"
    for path, names in defined.items():
        assert listed[path] == names, (
            f"{path}: not listed {sorted(names - listed[path])}, listed but not defined there "
            f"{sorted(listed[path] - names)}"
        )
