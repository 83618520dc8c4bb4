"""The CLI through Typer's CliRunner: help, dry runs, and one-line errors for user mistakes."""

import pytest
from typer.testing import CliRunner

from gnsweep.cli import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["launch", "analyze", "plot", "tasks"])
def test_every_command_has_help_with_an_example(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output


def test_tasks_lists_the_default_task():
    result = runner.invoke(app, ["tasks"])
    assert result.exit_code == 0
    assert "digits" in result.output


def test_dry_run_prints_the_grid_and_writes_nothing(tmp_path):
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["launch", "--dry-run", "--sweep-dir", str(out),
                                 "sweep.batch_sizes=[16,64,256]", "sweep.learning_rates=[0.1,0.3]"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("b00")]
    assert len(lines) == 6
    assert "6 runs" in result.output
    assert not out.exists()


@pytest.mark.parametrize(("args", "expected"), [
    (["launch", "sweep.batch_sizes=[-4]"], "sweep.batch_sizes: -4"),
    (["launch", "task=nope"], "task=nope"),
    (["launch", "sweep.learning_rates=[fast]"], "'fast' is not a number"),
    (["launch", "sweep.batch_sizes=[]"], "sweep.batch_sizes: the list is empty"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, expected, tmp_path):
    result = runner.invoke(app, [*args, "--sweep-dir", str(tmp_path / "s")])
    assert result.exit_code == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert not (tmp_path / "s").exists()


def test_analyze_refuses_a_folder_that_is_not_a_sweep(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a sweep folder" in result.stderr
    result = runner.invoke(app, ["analyze", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "no such folder" in result.stderr


def test_launch_help_documents_the_exit_codes():
    result = runner.invoke(app, ["launch", "--help"])
    text = " ".join(result.output.split())
    for code in ("0 every run ended done or diverged", "1 a run failed", "2 bad input",
                 "130 interrupted"):
        assert code in text


def test_help_paragraphs_are_not_cut_mid_sentence():
    """Each paragraph of a command's help is one line (the help wraps it at the terminal's
    width), but for its example lines: the docstring's own line breaks cut sentences in two."""
    from gnsweep.cli import VERBS, verb_info

    for command in [*map(verb_info, VERBS), *app.registered_commands]:
        assert command.help, command.callback
        for paragraph in command.help.split("\n\n"):
            for line in paragraph.splitlines()[1:]:
                assert line.startswith(("Example", "- ")), (command.callback, line)
    # Rendered 80 wide: within a paragraph every line but the last is filled (> 60 wide).
    result = runner.invoke(app, ["launch", "--help"], terminal_width=80)
    text = result.output.split("╭")[0].split("Usage:")[1]
    for paragraph in text.split("\n \n")[1:]:
        lines = [line.rstrip() for line in paragraph.strip("\n").splitlines()]
        assert all(len(line) > 60 for line in lines[:-1] if "Example" not in line), lines
