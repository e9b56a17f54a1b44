"""The CLI is testable through main(argv)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

import klpenalty
from klpenalty.cli import main


def test_env_prints_versions_and_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "klpenalty" in out and "torch" in out and "streaming" in out
    # the active CPU path and the build cache
    from klpenalty.ops import native

    path = "native" if native.available() else "streaming"
    assert f"cpu path  {path}" in out and str(native.build_dir()) in out


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_version_prints_name_and_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"klpenalty {klpenalty.__version__}\n"


def test_version_has_one_source():
    # pyproject.toml reads klpenalty.__version__ (dynamic), so the installed metadata agrees
    assert importlib.metadata.version("klpenalty") == klpenalty.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", klpenalty.__version__)


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["env", "--help"], ["bench", "--help"], ["demo", "--help"], ["report", "--help"]],
)
def test_help_is_plain_text(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: klpenalty")
    assert "``" not in out and ":func:" not in out and ":mod:" not in out
    if argv == ["--help"]:
        assert "env" in out and "bench" in out and "demo" in out and "--version" in out
        assert "report" in out
