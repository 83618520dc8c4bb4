import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

# Headless figures, and one torch thread per process: tests run beside each other on 2 cores,
# and one thread keeps the tiny sweep deterministic (the committed fit baseline relies on it).
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The real values of a sweep's masked secrets are kept per user (gnsweep.redact.remember): the
# tests keep theirs in a folder of their own, never the user's.
if "GNSWEEP_SECRET_DIR" not in os.environ:
    import tempfile

    os.environ["GNSWEEP_SECRET_DIR"] = tempfile.mkdtemp(prefix="gnsweep-test-secrets-")


# ---- each test starts from the same process-wide state -------------------------------------
# Tests share an xdist worker in an order that changes from run to run: what one leaves in the
# process (gnsweep's logger made to stop propagating by a worker served in-process, a launch's
# id in the environment, a warning said once a process) must not change what the next sees,
# e.g. whether `caplog` gets a warning.
_KEPT_ENV = ("GNSWEEP_LAUNCH", "GNSWEEP_SECRETS", "PYTHONPATH")
"""Set by a launch in the launcher's process (gnsweep.sweep.run_specs, gnsweep.redact; a
custom task's working directory on PYTHONPATH: gnsweep.tasks.importable_cwd)."""
_KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
"""Handled by a worker served in-process (gnsweep.executors.worker.StopFlag): left installed,
a later run's `watch_interrupts` would not see Python's own SIGINT handler."""
_THREADS = int(os.environ["OMP_NUM_THREADS"]) if os.environ["OMP_NUM_THREADS"].isdigit() \
    else None


def _gnsweep_loggers() -> dict[str, logging.Logger]:
    loggers = {name: item for name, item in logging.Logger.manager.loggerDict.items()
               if isinstance(item, logging.Logger)
               and (name == "gnsweep" or name.startswith("gnsweep."))}
    return {"gnsweep": logging.getLogger("gnsweep"), **loggers}


def _logger_state(logger: logging.Logger) -> tuple:
    return (list(logger.handlers), list(logger.filters), logger.level, logger.propagate,
            logger.disabled)


@pytest.fixture(autouse=True)
def _process_state_restored():
    """After each test: gnsweep's loggers as before it (handlers, filters, levels, propagation;
    a logger made during the test as Python makes one), the launch variables of the
    environment, sys.path and the signal handlers as before it, torch's thread count as the
    session's, no warning remembered as said (gnsweep.measure.common) and no script run's
    handle (gnsweep.run_handle)."""
    loggers = {name: _logger_state(item) for name, item in _gnsweep_loggers().items()}
    env = {name: os.environ.get(name) for name in _KEPT_ENV}
    path = list(sys.path)
    signals = {signum: signal.getsignal(signum) for signum in _KEPT_SIGNALS}
    yield
    for name, logger in _gnsweep_loggers().items():
        handlers, filters, level, propagate, disabled = loggers.get(
            name, ([], [], logging.NOTSET, True, False))
        logger.handlers[:], logger.filters[:] = handlers, filters
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    common = sys.modules.get("gnsweep.measure.common")  # imported only where a test needs it
    if common is not None:
        common._SAID.clear()
    sys.path[:] = path
    for signum, handler in signals.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    torch = sys.modules.get("torch")
    if torch is not None and _THREADS and torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
    run_handle = sys.modules.get("gnsweep.run_handle")
    if run_handle is not None:
        run_handle._current = None


def session_folder(tmp_path_factory, name: str, make) -> Path:
    """`make(folder)` once per test session into <the session's temporary folder>/<name>/:
    under xdist into the folder its workers share, by the first worker that needs it (the others
    wait for it, then read it). Tests change only copies of it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    from gnsweep import store

    out, made = root / f"{name}-source" / name, root / f"{name}-source" / "made"
    with store.exclusive(root / f"{name}-source.lock"):
        if not made.exists():
            shutil.rmtree(out.parent, ignore_errors=True)  # a launch that failed half-way
            out.parent.mkdir()
            make(out)
            made.touch()
    return out


@pytest.fixture(scope="session")
def _tiny_sweep_once(tmp_path_factory):
    """`gnsweep launch sweep=tiny` through the CLI, once per test session (`session_folder`)."""
    from typer.testing import CliRunner

    from gnsweep.cli import app

    def make(out: Path) -> None:
        result = CliRunner().invoke(app, ["launch", "sweep=tiny", "--sweep-dir", str(out),
                                          "--workers", "2", "--quiet"])
        assert result.exit_code == 0, result.output

    return session_folder(tmp_path_factory, "tiny", make)


@pytest.fixture(scope="session")
def local_executor_sweep(tmp_path_factory):
    """The executor tests' tiny grid (tests/helpers/executor_sweeps.TINY) on the local
    executor, once per test session (`session_folder`): the reference that torchrun's and
    Slurm's runs of the same grid are compared with. Read only."""
    from executor_sweeps import run_sweep

    return session_folder(tmp_path_factory, "executor-local", run_sweep)


@pytest.fixture(scope="module")
def tiny_sweep(_tiny_sweep_once, tmp_path_factory):
    """A module's own copy of the launched tiny sweep (modules analyze, plot and relaunch it)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(_tiny_sweep_once, out)
    return out


# ---- a test that starts a process is marked ----------------------------------------------
# `make test-fast` deselects these markers and must start no process: a test that starts one
# (a sweep's workers, torchrun, a command in a subprocess) carries one of them. The rule is
# enforced, not remembered: a test using a fixture that launches a sweep is marked `slow` at
# collection, and any other unmarked test that starts a process (in its fixtures or its body)
# fails, saying which marker to add.
PROCESS_MARKERS = frozenset({"slow", "distributed", "slurm", "browser", "process"})
PROCESS_FIXTURES = frozenset({"_tiny_sweep_once", "tiny_sweep", "local_executor_sweep"})
"""Fixtures of this file that launch a sweep."""


def _marked(item) -> bool:
    return bool(PROCESS_MARKERS & {m.name for m in item.iter_markers()})


FIRST_GROUPS = ("slurm", "truth_end_to_end")
"""The longest groups of tests that share one xdist worker (Slurm's requeue waits, the linreg
truth sweep): collected first, so that they start first and the other workers fill in beside
them, instead of running alone at the end of the suite."""
LONG_MARKERS = frozenset({"slow", "distributed", "slurm", "browser"})
"""Tests that run sweeps or process groups (seconds to a minute each): their modules are
collected next, whole, before the modules of quick tests only, so that the last tests a worker
takes are short and the workers end together (xdist hands tests out in the order collected;
`--dist loadgroup` moves only the groups, by size, ahead of them). A module stays in one piece:
a worker builds a module-scoped fixture again each time it comes back to the module."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _marked(item) and PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

    long = {item.nodeid.split("::")[0] for item in items
            if LONG_MARKERS & {m.name for m in item.iter_markers()}}

    def first(item) -> int:
        group = item.get_closest_marker("xdist_group")
        if group is not None and group.args and group.args[0] in FIRST_GROUPS:
            return 0
        return 1 if item.nodeid.split("::")[0] in long else 2

    items.sort(key=first)  # stable: the order within each part is kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _marked(item):
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.fail(f"{item.nodeid} starts a process but carries none of the markers "
                    f"{sorted(PROCESS_MARKERS)}: mark it @pytest.mark.process (slow where it runs "
                    "a sweep) so that `make test-fast` stays free of processes", pytrace=False)

    patch = pytest.MonkeyPatch()
    patch.setattr(subprocess.Popen, "_execute_child", refuse)
    patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    try:
        yield
    finally:
        patch.undo()
