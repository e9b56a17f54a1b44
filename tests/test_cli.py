"""The CLI is testable through main(argv)."""

from __future__ import annotations

import pytest

from klpenalty.cli import main


def test_env_prints_versions_and_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "klpenalty" in out and "torch" in out and "streaming" in out


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
