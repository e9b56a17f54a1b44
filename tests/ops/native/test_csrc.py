"""The C++ folder of the native backend (klpenalty/ops/native/csrc) as files: every file takes
part in the build's hash, the wheel ships every one, the includes resolve, and the constants of
contract.h are those of klpenalty/ops/contract.py. Nothing here compiles."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from klpenalty.ops import contract, native

ROOT = Path(__file__).resolve().parents[3]

# contract.h's form: one `constexpr int64_t k<Name> = <value>;` per line
CONSTANT = re.compile(r"^constexpr int64_t (k\w+) = (-?\d+);", re.M)
# contract.py's constants that contract.h mirrors (Want's members count as WANT_<member>)
MIRRORED = re.compile(r"(ST|SX|OUT)_[A-Z0-9_]+|(OUT|STATS|STATE)_COLS")


def _key(name: str) -> str:
    """The spelling both sides share: no underscores, no case (C++ drops its leading 'k')."""
    return name.replace("_", "").lower()


def _header_constants() -> dict[str, tuple[str, int]]:
    text = (native.CSRC / "contract.h").read_text()
    lines = [ln for ln in text.splitlines() if "constexpr" in ln.split("//")[0]]
    found = CONSTANT.findall(text)
    assert len(found) == len(lines), f"contract.h has constants of another form: {lines}"
    constants = {_key(name[1:]): (name, int(value)) for name, value in found}
    assert len(constants) == len(found), f"a constant of contract.h repeats: {found}"
    return constants


def _python_constants() -> dict[str, tuple[str, int]]:
    names = {f"WANT_{member.name}": int(member) for member in contract.Want}
    for name, value in vars(contract).items():
        if MIRRORED.fullmatch(name) and isinstance(value, int) and not isinstance(value, bool):
            names[name] = value
    return {_key(name): (name, value) for name, value in names.items()}


def test_contract_header_mirrors_contract_py():
    cpp, py = _header_constants(), _python_constants()
    assert len(py) == 27, sorted(name for name, _ in py.values())  # 4 + 3 + 4 + 10 + 6
    missing = sorted(name for key, (name, _) in py.items() if key not in cpp)
    extra = sorted(name for key, (name, _) in cpp.items() if key not in py)
    assert not missing, f"contract.h lacks a constant for {missing}"
    assert not extra, f"contract.h has constants contract.py does not: {extra}"
    differ = [(py[key][0], py[key][1], name, value) for key, (name, value) in cpp.items()
              if value != py[key][1]]
    assert not differ, f"contract.h differs from contract.py (python, value, c++, value): {differ}"


def test_contract_header_check_fails_on_a_changed_value(tmp_path, monkeypatch):
    """The check above reads the header it is pointed at: a changed value or a missing line fails."""
    copy = tmp_path / "csrc"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    header = copy / "contract.h"
    text = header.read_text()
    header.write_text(text.replace("kStTau = 9;", "kStTau = 8;"))
    with pytest.raises(AssertionError, match="ST_TAU"):
        test_contract_header_mirrors_contract_py()
    header.write_text(text.replace("constexpr int64_t kSxB = 5;\n", ""))
    with pytest.raises(AssertionError, match="SX_B"):
        test_contract_header_mirrors_contract_py()


def test_every_csrc_file_takes_part_in_the_build_hash(tmp_path, monkeypatch):
    files = sorted(path.name for path in native.CSRC.iterdir() if path.is_file())
    assert [path.name for path in native.csrc_files()] == files
    assert [path.name for path in native.sources()] == [n for n in files if n.endswith(".cpp")]
    assert any(name.endswith(".h") for name in files)
    base = native.build_name("AVX2")
    copy = tmp_path / "csrc"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    assert native.build_name("AVX2") == base  # the same names and bytes: the same build
    for name in files:
        path = copy / name
        data = path.read_bytes()
        path.write_bytes(data + b"\n")
        assert native.build_name("AVX2") != base, f"{name} does not take part in the hash"
        path.write_bytes(data)
    assert native.build_name("AVX2") == base
    (copy / "simd.h").rename(copy / "simd2.h")  # the names count too
    assert native.build_name("AVX2") != base
    (copy / "simd2.h").rename(copy / "simd.h")
    (copy / "extra.h").write_text("#pragma once\n")  # and a new file
    assert native.build_name("AVX2") != base


def test_the_build_units_include_every_source_once(tmp_path):
    """The translation units the build compiles: BUILD_UNITS files in the build directory that
    include each source once, by path, their sizes within the largest source of each other;
    written again only when they change (ninja then keeps the objects)."""
    units = native.build_units(tmp_path)
    assert len(units) == min(native.BUILD_UNITS, len(native.sources())) == 2
    groups = [[Path(line.split('"')[1]) for line in unit.read_text().splitlines()]
              for unit in units]
    assert sorted(p for group in groups for p in group) == native.sources()
    sizes = [sum(p.stat().st_size for p in group) for group in groups]
    assert max(sizes) - min(sizes) <= max(p.stat().st_size for p in native.sources())
    stamps = [unit.stat().st_mtime_ns for unit in units]
    assert native.build_units(tmp_path) == units
    assert [unit.stat().st_mtime_ns for unit in units] == stamps


def test_csrc_includes_resolve_and_the_package_data_ships_every_file():
    files = {path.name for path in native.csrc_files()}
    for name in sorted(files):
        for include in re.findall(r'^#include "([^"]+)"', (native.CSRC / name).read_text(), re.M):
            assert include in files, f"{name} includes {include}, which csrc lacks"
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["klpenalty"]
    package = Path(native.__file__).resolve().parents[2]  # src/klpenalty
    for path in native.csrc_files():
        relative = path.resolve().relative_to(package)
        assert any(relative.match(g) for g in globs), f"package-data {globs} misses {relative}"
