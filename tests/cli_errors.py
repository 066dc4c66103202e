"""The check every input-error test of ``reprlab run`` makes: exit status 2, the message, no traceback, no folder."""

from pathlib import Path

from typer.testing import CliRunner

from reprlab.cli import app


def assert_run_refused(out: Path, recipe: str, overrides: list[str], expected: str) -> None:
    """``reprlab run RECIPE --out OUT OVERRIDES`` stops with ``expected`` in its one-line error and makes no ``out``."""
    result = CliRunner().invoke(app, ["run", recipe, "--out", str(out), *overrides])
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()
