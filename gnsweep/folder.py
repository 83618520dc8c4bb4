"""An opened sweep folder: its typed config (config.yaml parsed and validated once), its run
records checked once against it, and its paths (a `paths.SweepPaths`, as submitit's `JobPaths`
derives every path of a job from its folder).

A command opens the folder once at its start (`SweepFolder.open`: the folder is a sweep, its
config.yaml reads, every run file agrees with it) and passes the object down; a worker opens it
once at its start (`SweepFolder.of_config`: the config only, the launcher verified the runs)
and reads each run's record from it (`SweepFolder.read_run`); a launch hands its workers the
folder it wrote (`sweep.prepare_folder`). Every file name and path lives in `paths`.

`SweepFolder.curves` and `SweepFolder.tables` read the runs' statuses and metrics files and
hand the analysis (`gnsweep.analysis.load`) the tables it computes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from gnsweep import store, tasks
from gnsweep.config import Config
from gnsweep.errors import ConfigError, StoreError
from gnsweep.noise import Method
from gnsweep.noise_plan import ALL, Assignment, Outcome, best_rates, measured_as_planned, plan_runs
from gnsweep.paths import RunPaths, SweepPaths
from gnsweep.runs import (
    RunSpec,
    check_record,
    checked_record,
    expected_record_config,
    parse_run_record,
    parse_spec,
)

if TYPE_CHECKING:  # the analysis (pandas) is imported where rows are read, not by a worker
    import pandas as pd

    from gnsweep.analysis.load import RunTables
    from gnsweep.analysis.results import Results
    from gnsweep.analysis.steps import Curves

__all__ = ["RunPaths", "SweepFolder", "SweepPaths", "load_curves", "load_run_curves", "load_sweep",
           "read_config", "read_noise_plan", "read_results", "read_run", "verify_folder"]


def read_config(root: Path) -> Config:
    """The typed config of a sweep folder (its config.yaml), its task checked against the
    registry (`tasks.checked`); needs no torch and no Hydra. Parses the file: call it once,
    where the folder is opened (`SweepFolder`), and pass the config down.

    StoreError names a missing or unreadable file; ConfigError one whose settings this version
    of gnsweep does not accept (the message names the file and the setting).
    """
    root = Path(root)
    loaded = store.read_sweep_config(root)
    try:
        return tasks.checked(Config.from_dict(loaded))
    except ConfigError as err:
        raise ConfigError(f"{SweepPaths(root).config_file}: {err}") from None


class SweepFolder(SweepPaths):
    """One opened sweep folder: `root`, its typed `config`, its runs' grid points (`specs`,
    when opened verified) and the paths of its files (`SweepPaths`)."""

    def __init__(self, root: Path, config: Config | None,
                 specs: dict[str, RunSpec] | None = None) -> None:
        super().__init__(Path(root))
        self._config = config
        self._specs = specs

    @property
    def config(self) -> Config:
        """The sweep's config, typed. A worker's folder whose config.yaml did not read at its
        start (`for_worker`) reads it here, again at each use until it reads: each run then
        fails with the reason, and a config a relaunch wrote since is the one used."""
        if self._config is None:
            self._config = read_config(self.root)
        return self._config

    # ---- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, root: Path, config: Config | None = None) -> SweepFolder:
        """The folder opened and verified, what every command that reads a sweep folder calls
        before it builds anything from it: the folder is a sweep, its config.yaml reads (parsed
        once, here), and every run file is checked against it (`runs.check_record`; its config
        must be one this version accepts). A run file holding only a grid point (no config:
        written by another tool for the analysis) is type-checked; it names no code.
        StoreError or ConfigError (exit 2) naming the first file that disagrees. `config`: the
        folder's config, typed, where the caller holds it already (a command that opened the
        folder before and reads its runs again); not parsed again then."""
        root = Path(root)
        store.require_sweep(root)
        config = config if config is not None else read_config(root)
        expected = expected_record_config(config)
        specs: dict[str, RunSpec] = {}
        accepted: set[str] = set()  # the runs of one launch share their config: typed once
        for run_id in store.run_ids(root):
            path = SweepPaths(root).run(run_id).record
            data = store.read_json(path)
            if isinstance(data, dict) and "config" not in data and "run_id" not in data:
                specs[run_id] = parse_spec(data.get("run"), path)
                continue
            specs[run_id] = checked_record(data, path, run_id, expected, accepted)
        return cls(root, config, specs)

    @classmethod
    def of_config(cls, root: Path) -> SweepFolder:
        """The folder with its config.yaml read (parsed once, here) and nothing else checked:
        a worker's start (the launcher verified the runs; each run's record is checked against
        this config when the worker reads it, `read_run`)."""
        return cls(Path(root), read_config(Path(root)))

    @classmethod
    def for_worker(cls, root: Path | str) -> SweepFolder:
        """A worker's folder, opened once at its start: its config.yaml parsed (`of_config`), or,
        where it does not read, the folder without it (`config` reads it at each use and
        raises the reason there, so that each run fails with it)."""
        try:
            return cls.of_config(Path(root))
        except Exception:
            return cls(Path(root), None)

    # ---- what it holds ------------------------------------------------------------------

    @property
    def specs(self) -> dict[str, RunSpec]:
        """Each run's grid point by id (verified at `open`)."""
        if self._specs is None:
            raise StoreError(f"{self.root}: opened without its runs; open it with "
                             "SweepFolder.open")
        return self._specs

    def read_run(self, run_id: str) -> tuple[Config, RunSpec]:
        """A run's record, checked against this folder's config (`runs.check_record`): the
        config it trains with and its grid point. Nothing in a run file that config.yaml does
        not say is ever used (a task's `_target_` above all: it names code to import)."""
        path = self.run(run_id).record
        data = store.read_json(path)
        check_record(data, path, run_id, expected_record_config(self.config))
        config, spec = parse_run_record(data)
        return measured_as_planned(config, self.read_noise_plan().get(run_id)), spec

    # ---- which runs measure the noise scale (`gnsweep.noise_plan`) -------------------------

    def read_noise_plan(self) -> dict[str, Assignment]:
        """`read_noise_plan(self.root)`."""
        return read_noise_plan(self.root)

    def plan_noise(self, run_ids: list[str]) -> dict[str, Assignment]:
        """Record the part of every run of `run_ids` not yet planned (`noise_plan.plan_runs`,
        with the best learning rates the folder's finished runs show), under the folder's lock,
        atomically, before any of them starts; returns the whole plan. A run's part never
        changes once recorded. Nothing is planned under noise.method=none."""
        if self.config.noise.method == Method.NONE:
            return self.read_noise_plan()
        from gnsweep import tasks

        falling = not tasks.about(self.config.task).direction.rises
        with store.exclusive(self.lock):
            planned = self.read_noise_plan()
            if all(r in planned for r in run_ids):
                return planned
            specs, outcomes = [], []
            for run_id in sorted(set(store.run_ids(self.root)) | set(run_ids)):
                data = store.read_json(self.run(run_id).record)
                spec = parse_spec(data.get("run") if isinstance(data, dict) else None,
                                  self.run(run_id).record)
                specs.append(spec)
                status = store.read_status(self.run(run_id).folder)
                if run_id in run_ids and run_id not in planned and status.attempts:
                    # Begun before the sweep planned its measurement (a folder of an older
                    # version): its checkpoint goes on measuring as it began.
                    planned[run_id] = Assignment(ALL, "began before the measurement was planned")
                if status.state in store.FINISHED and status.steps:
                    outcomes.append(Outcome(spec.batch_size, spec.learning_rate,
                                            spec.at_examples, float(status.steps),
                                            _number(status.final_loss),
                                            status.reason == "target"))
            # Runs of the folder outside this call and never planned (finished by an older
            # version) measured as configured then.
            known = {**{s.run_id: Assignment(ALL, "") for s in specs}, **planned}
            fresh = plan_runs(specs, self.config.noise.runs,
                              {k: a for k, a in known.items() if k not in run_ids or k in planned},
                              best_rates(outcomes, falling), every=self.config.noise.every)
            planned.update({k: v for k, v in fresh.items() if k in run_ids})
            store.write_json(SweepPaths(self.root).noise_plan,
                             {"runs": {k: a.as_dict() for k, a in sorted(planned.items())}})
        return planned

    # ---- the runs' rows, for the analysis ------------------------------------------------

    def run_tables(self, skip_corrupt: bool = False) -> RunTables:
        """Every run of the folder (its grid point and state) and its metrics table: a
        finished run's metrics.parquet, a running run's parts so far, None otherwise. A
        finished run without readable metrics, or whose rows disagree with its status.json, is
        named (state 'corrupt', `problem`), never dropped or analysed in silence; an unreadable
        file raises StoreError naming it unless `skip_corrupt`."""
        import pandas as pd

        from gnsweep.analysis.load import RunTables, rows_problem
        rows, tables = [], []
        for run_id, spec in self.specs.items():
            paths = self.run(run_id)
            status = store.read_status(paths.folder)
            state = status.state.value
            row: dict[str, Any] = {
                "run_id": run_id, "batch_size": spec.batch_size,
                "learning_rate": spec.learning_rate, "seed": spec.seed, "state": state,
                "exchange_rate": spec.exchange_rate, "at_examples": spec.at_examples,
                "along": spec.along, "problem": "", "samples": spec.batch_size}
            table = None
            if state in store.FINISHED:
                if not paths.metrics.exists() or paths.metrics.is_symlink():
                    row.update(state="corrupt", problem=f"recorded {state}, but its "
                               f"{paths.metrics.name} is missing")
                else:
                    try:
                        table = read_metrics_file(paths.metrics)
                        problem = rows_problem(table) or _disagrees(paths, table, status)
                        if problem is not None:
                            row.update(state="corrupt", problem=f"recorded {state}, but its "
                                       f"{paths.metrics.name} is {problem}")
                            table = None
                    except StoreError as err:
                        if not skip_corrupt:
                            raise StoreError(
                                f"{err}; relaunch the sweep (the same `gnsweep launch ... "
                                f"--sweep-dir {self.root}` command) to run that run again, or "
                                f"leave it out: gnsweep analyze {self.root} --skip-corrupt"
                            ) from None
                        row.update(state="corrupt", problem=f"recorded {state}, but its "
                                   f"{paths.metrics.name} is unreadable")
            elif state == store.RunState.RUNNING:
                table = live_metrics(paths.folder)
            rows.append(row)
            tables.append(table)
        if not rows:
            raise StoreError(f"{self.root}: the sweep has no runs")
        return RunTables(pd.DataFrame(rows), tables)

    def curves(self, skip_corrupt: bool = False) -> Curves:
        """Every run and its logged rows as flat arrays (`analysis.load.curves_of`)."""
        from gnsweep.analysis.load import curves_of

        return curves_of(self.run_tables(skip_corrupt))

    def tables(self, skip_corrupt: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(runs, metrics) frames of the sweep (`analysis.load.sweep_frames`)."""
        from gnsweep.analysis.load import sweep_frames

        return sweep_frames(self.run_tables(skip_corrupt))


def read_results(out_dir: Path) -> Results:
    """The results an analysis wrote into a folder (a sweep folder, or `gnsweep analyze
    --out`'s), `store.read_result_tables` made one `Results`. Tables that an older version did
    not write (lr_fits, loss_scaling) read as empty; steps, front and fits must exist."""
    from gnsweep.analysis.results import Results

    return Results(**store.read_result_tables(Path(out_dir)))


def run_curves_of(run_dir: Path) -> Curves:
    """One run's logged rows (a branch sweep's base run), read from its folder: its record
    (config.json) and its metrics, whatever its state (a base run may still be training)."""
    from gnsweep.analysis.load import rows_problem, run_curves

    paths = RunPaths(Path(run_dir))
    record = store.read_json(paths.record)
    table = read_metrics_file(paths.metrics) if paths.metrics.is_file() \
        else live_metrics(paths.folder)
    if table is None:
        raise StoreError(f"{run_dir}: no metrics logged yet")
    problem = rows_problem(table)
    if problem is not None:
        raise StoreError(f"{paths.metrics}: {problem}")
    spec = record.get("run") or {} if isinstance(record, dict) else {}
    run_id = str(record.get("run_id", paths.run_id)) if isinstance(record, dict) \
        else paths.run_id
    return run_curves(run_id, spec, store.read_status(paths.folder).state.value, table)


def _checked_numbers(table: pa.Table, path: Path) -> pa.Table:
    from gnsweep.analysis.load import numeric_problem

    problem = numeric_problem(table)
    if problem is not None:
        raise StoreError(f"{path}: unreadable ({problem})")
    return table


def _disagrees(paths: RunPaths, table: pa.Table, status: store.RunStatus) -> str | None:
    """How a finished run's rows disagree with its status.json (`store.rows_disagree`)."""
    def last() -> dict[str, Any]:
        return {name: table.column(name)[-1].as_py() for name in ("step", "examples")}

    return store.rows_disagree(status, table.num_rows, last,
                               lambda: store.log_every(paths.folder))


def read_metrics_file(path: Path) -> pa.Table:
    """The analysis' columns of one metrics file that hold a number: a float column that the
    file's own statistics say is all NaN (probes, exact truth, B_noise in most runs) is left
    out, unread; the analysis takes a missing column as NaN.

    `ParquetFile.read` is about twice as fast per small file as `read_table` (no dataset
    discovery) but skips a missing column silently; anything unexpected goes through
    `store.read_table`, which raises StoreError naming the file. One thread: handing a few
    columns of a few thousand rows to pyarrow's pool costs more than decoding them (half the
    read time on `gnsweep bench analysis`'s 2,000-row files, more on a busy machine).
    """
    from gnsweep.analysis.load import METRIC_COLUMNS, OPTIONAL_COLUMNS

    try:
        file = pq.ParquetFile(store.require_regular(path))
        names = set(file.schema_arrow.names)
        if not names.issuperset(METRIC_COLUMNS):
            raise ValueError("core columns missing")
        empty = _all_nan(file)
        table = file.read(columns=[c for c in METRIC_COLUMNS + OPTIONAL_COLUMNS
                                   if c in names and c not in empty], use_threads=False)
    except (pa.ArrowException, OSError, ValueError, StoreError):
        table = store.read_table(path, columns=METRIC_COLUMNS)
    return _checked_numbers(table, path)


def _all_nan(file: pq.ParquetFile) -> set[str]:
    """Float columns with no number in any row group, by the statistics of the Arrow C++ writer
    (the store's; it leaves NaN out of min/max, so a column of NaN has none). Files from other
    writers: nothing is assumed (every column is read)."""
    from gnsweep.analysis.load import ANALYSIS_COLUMNS

    meta = file.metadata
    if not str(meta.created_by).startswith("parquet-cpp-arrow") or meta.num_row_groups == 0:
        return set()
    schema = file.schema_arrow
    # The analysis' float columns only, by position (a flat schema: arrow field i is parquet
    # column i), not all the file's.
    # Never the step and examples a run's rows are checked by (a step column of NaN is named).
    wanted = {i: f.name for i, f in enumerate(schema)
              if f.name in ANALYSIS_COLUMNS and pa.types.is_floating(f.type)
              and f.name not in ("step", "examples")}
    empty = set(wanted.values())
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i, name in wanted.items():
            stats = group.column(i).statistics
            if stats is None or stats.has_min_max:
                empty.discard(name)
    return empty


def live_metrics(run_dir: Path) -> pa.Table | None:
    """The rows a training run has written so far (its metrics parts), with the analysis'
    columns; None before its first part or when a part cannot be read yet."""
    import numpy as np

    from gnsweep.analysis.load import (
        METRIC_COLUMNS,
        OPTIONAL_COLUMNS,
        numeric_problem,
        rows_problem,
    )

    try:
        table = store.read_metrics(run_dir)
        if table is None or not table.num_rows or numeric_problem(table) \
                or rows_problem(table):
            return None
    except StoreError:
        if store.is_special(RunPaths(run_dir).metrics):
            raise  # a FIFO or device there: refused in one line, never waited on
        return None
    names = [c for c in METRIC_COLUMNS + OPTIONAL_COLUMNS if c in table.column_names]
    table = table.select(names)
    for name in OPTIONAL_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.array(np.full(table.num_rows, np.nan)))
    return table


def read_noise_plan(root: Path) -> dict[str, Assignment]:
    """Each planned run's part in the noise measurement (`noise_plan.Assignment`), by id;
    empty where none is recorded (a folder of an older version: every run measured). Reads
    the plan file alone (no config.yaml). StoreError naming the file where it is not a plan
    gnsweep wrote."""
    path = SweepPaths(root).noise_plan
    if not (path.exists() or path.is_symlink()):
        return {}
    data = store.read_json(path)
    runs = data.get("runs") if isinstance(data, dict) else None
    plan = {k: Assignment.of(v) for k, v in runs.items()} if isinstance(runs, dict) else {}
    if not isinstance(runs, dict) or any(a is None for a in plan.values()):
        raise StoreError(f"{path}: not a noise plan of gnsweep (an object whose \"runs\" "
                         "maps run ids to a role and a reason); remove it and relaunch to "
                         "plan the runs not yet trained again")
    return {k: a for k, a in plan.items() if a is not None}


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


# The readers by path, for scripts and tests that hold a folder's path: each opens the folder
# (verified) and reads what it asks for.


def verify_folder(root: Path) -> tuple[Config, dict[str, RunSpec]]:
    """(config, specs) of the folder opened verified (`SweepFolder.open`)."""
    folder = SweepFolder.open(root)
    return folder.config, folder.specs


def read_run(root: Path, run_id: str) -> tuple[Config, RunSpec]:
    """`SweepFolder.of_config(root).read_run(run_id)`: one run's record, checked."""
    return SweepFolder.of_config(root).read_run(run_id)


def load_curves(root: Path, skip_corrupt: bool = False) -> Curves:
    """`SweepFolder.open(root).curves(skip_corrupt)`."""
    return SweepFolder.open(root).curves(skip_corrupt)


def load_sweep(root: Path, skip_corrupt: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`SweepFolder.open(root).tables(skip_corrupt)`."""
    return SweepFolder.open(root).tables(skip_corrupt)


load_run_curves = run_curves_of
