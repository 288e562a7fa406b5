"""The generated units: the binding files in one, every other source in the
other, once each, and rewritten only when a source changes."""

import os

from ddp_ext import _build_info
from ddp_ext._translation_units import bindings_unit_name, translation_units

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _included(unit):
    with open(unit) as f:
        return [line.split('"')[1] for line in f if line.startswith("#include")]


def test_units_include_every_source_once(tmp_path):
    bindings, unit = translation_units(ROOT, _build_info.SOURCES, _build_info.BINDING_SOURCES, str(tmp_path))
    assert os.path.basename(bindings) == bindings_unit_name(os.path.basename(unit))
    assert _included(bindings) == _build_info.BINDING_SOURCES
    assert sorted(_included(unit)) == sorted(s for s in _build_info.SOURCES if s not in _build_info.BINDING_SOURCES)


def test_a_lone_binding_file_is_its_own_unit(tmp_path):
    binding, unit = translation_units(ROOT, _build_info.MPI_SOURCES, _build_info.MPI_BINDING_SOURCE, str(tmp_path))
    assert binding == os.path.join(ROOT, _build_info.MPI_BINDING_SOURCE)
    assert sorted(_included(unit)) == sorted(s for s in _build_info.MPI_SOURCES if s != _build_info.MPI_BINDING_SOURCE)


def test_core_unit_is_rewritten_only_when_a_source_changes(tmp_path):
    (tmp_path / "src").mkdir()
    for name in ("bind.cpp", "a.cpp", "b.cpp"):
        (tmp_path / "src" / name).write_text(f"// {name}\n")
    sources = ["src/bind.cpp", "src/a.cpp", "src/b.cpp"]
    out = str(tmp_path / "out")
    _, unit = translation_units(str(tmp_path), sources, "src/bind.cpp", out)
    assert _included(unit) == ["src/a.cpp", "src/b.cpp"]
    first_text, first_mtime = open(unit).read(), os.stat(unit).st_mtime_ns

    os.utime(unit, ns=(first_mtime - 10**9, first_mtime - 10**9))
    translation_units(str(tmp_path), sources, "src/bind.cpp", out)
    assert os.stat(unit).st_mtime_ns == first_mtime - 10**9, "rewritten although nothing changed"

    (tmp_path / "src" / "b.cpp").write_text("// b.cpp, changed\n")
    translation_units(str(tmp_path), sources, "src/bind.cpp", out)
    assert open(unit).read() != first_text, "the digest did not follow a changed source"
