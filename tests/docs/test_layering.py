"""The reducer's folders are layers, in the order docs/DEVELOPMENT.md (Layout)
gives: an #include in reducer/ or comm_hooks/ never climbs from a lower
folder to a higher one, and nothing in reducer/ includes comm_hooks/ (hooks
implement the reducer's BucketHook, not the other way round)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)
ORDER = re.compile(r"^The reducer's layers, lowest first: (.*)$", re.M)


def _layers():
    with open(os.path.join(ROOT, "docs", "DEVELOPMENT.md")) as f:
        found = ORDER.search(f.read())
    assert found, "docs/DEVELOPMENT.md names no order of the reducer's layers"
    return re.findall(r"`reducer/(\w+)/`", found.group(1))


def _sources(folder):
    for pattern in ("*.h", "*.cpp"):
        yield from glob.glob(os.path.join(ROOT, folder, "**", pattern), recursive=True)


def _includes(path):
    with open(path) as f:
        return INCLUDE.findall(f.read())


def _layer(path):
    parts = path.split("/")
    return parts[1] if parts[0] == "reducer" and len(parts) > 2 else None


def test_the_layer_order_names_every_reducer_folder():
    folders = sorted(
        name for name in os.listdir(os.path.join(ROOT, "reducer"))
        if os.path.isdir(os.path.join(ROOT, "reducer", name))
    )
    assert sorted(_layers()) == folders


def test_no_include_climbs_a_layer():
    rank = {name: i for i, name in enumerate(_layers())}
    upward = []
    for path in _sources("reducer"):
        source = os.path.relpath(path, ROOT)
        for included in _includes(path):
            if included.startswith("comm_hooks/"):
                upward.append(f"{source} includes {included} (reducer/ never includes comm_hooks/)")
            target = _layer(included)
            if target is not None and rank[target] > rank[_layer(source)]:
                upward.append(f"{source} includes {included}, a higher layer")
    assert not upward, "\n".join(upward)


def test_comm_hooks_reach_the_reducer_only_through_its_transport():
    reached = []
    for path in _sources("comm_hooks"):
        for included in _includes(path):
            if included.startswith("reducer/") and not included.startswith("reducer/transport/"):
                reached.append(f"{os.path.relpath(path, ROOT)} includes {included}")
    assert not reached, "\n".join(reached)


def test_the_checks_see_includes():
    # Guards the parsing: the reducer's top includes lower layers.
    assert any(i.startswith("reducer/transport/") for i in _includes(os.path.join(ROOT, "reducer", "core", "reducer.h")))
