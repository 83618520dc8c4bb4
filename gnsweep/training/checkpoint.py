"""A run's checkpoints: its whole state saved into its own folder as it trains, and loaded back
so that a relaunch continues it exactly (the same rows as a run never interrupted).

    <run>/checkpoints/<step:012d>.pt     torch.save of `TrainState.state_dict()` without the
                                         rows (they stream to the run's metrics parts)
    <run>/checkpoints/<step:012d>.json   the sidecar: run id, fingerprint, step, examples,
                                         rows logged, and the .pt's size and sha256

Both files are written atomically, the sidecar last: a .pt without one is an unfinished save and
is never read. A checkpoint is loaded only when its sidecar names this run and this run's
fingerprint (its configuration, grid point, world size and the model's parameter shapes: a
checkpoint of anything else is refused) and the .pt's size and checksum match; then with
`torch.load(weights_only=True)`. A bad one is said in one line and the previous one is tried.

Rank 0 writes; under torch.distributed every rank takes part in a save (each rank's own data
position and random state are gathered into the one file) and loads the same file.

For branching from a run's checkpoints: `kept(run_dir)` lists them, `load_into(state, path)`
loads one into a freshly built state.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gnsweep import store
from gnsweep.errors import StoreError
from gnsweep.paths import RunPaths
from gnsweep.training.state import TrainState

IDENTITY = "identity"
"""The key of a checkpoint's content naming its run, fingerprint, step and examples."""
FORMAT = 1
"""The layout of a checkpoint; another one is refused."""
ROWS_EVERY_S = 30.0
"""Between checkpoints, a run's new rows reach its folder at least this often."""

Keep = Callable[[int, int], bool]
"""keep(step, examples): whether a checkpoint taken there outlives the next one."""

# Settings that decide where and how a run executes or is analysed, not what it trains: a
# checkpoint taken under other values of these continues the same run.
_NOT_TRAINING = {"sweep": ("name", "batch_sizes", "learning_rates", "seeds", "exchange_rates",
                           "max_retries", "eps_max", "adaptive_lr", "adaptive_lr_noise"),
                 "train": ("checkpoint_every", "checkpoint_seconds", "keep_checkpoints_at",
                           "keep_checkpoints")}


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint on disk, as its sidecar describes it."""

    path: Path
    """The .pt file."""
    step: int
    examples: int
    rows: int
    """Metrics rows the run had logged when it was taken."""
    keep: bool = False
    """Kept past the next checkpoint and the run's end (`Checkpointer`'s keep rules)."""
    taken_for: tuple[int, ...] = ()
    """The `keep_at` points (examples) it was taken for: it is the first step boundary at or
    past each."""


def fingerprint(state: TrainState) -> str:
    """What a checkpoint must have been taken under to continue `state`: the run's training
    settings (task and options, grid point, noise measurement, recipe, stopping rule), the DDP
    world size (each rank's data position is its own) and the model's parameter names, shapes
    and dtypes (a code version that changes the model). A sha256 in hex."""
    config = state.config.to_dict()
    for section, names in _NOT_TRAINING.items():
        for name in names:
            config.get(section, {}).pop(name, None)
    for section in ("executor", "analysis", "logger"):
        config.pop(section, None)
    model = [(name, list(p.shape), str(p.dtype)) for name, p in state.model.state_dict().items()]
    what = {"config": config, "spec": asdict(state.spec), "world": state.world, "model": model,
            "format": FORMAT}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def resumable(state: TrainState) -> str | None:
    """Why this run cannot be checkpointed (None: it can). A task that keeps state of its own
    outside the run's (cartpole's environments and their returns) says so with
    `resumable = False`: resuming it would not continue the same run."""
    if getattr(state.task, "resumable", True):
        return None
    return (f"task {state.config.task.name} keeps state outside the run's (its environments): "
            "no checkpoints; an interrupted run starts again")


class Checkpointer:
    """Saves one run's checkpoints and streams its rows into its folder (rank 0:
    `run_dir`; other ranks pass None and take part in the collective steps only).

    `every_steps` (0: off) and `every_seconds` (0: off) say when a checkpoint is due. Besides
    the latest, a checkpoint is kept (outlives the next one and the run's end) when it is the
    first at or past one of `keep_at` (examples; a checkpoint is then taken there) or when
    `keep(step, examples)` says so; its sidecar records it (`keep`)."""

    def __init__(self, run_dir: Path | None, *, every_steps: int = 0,
                 every_seconds: float = 600.0, keep_at: Sequence[int] = (),
                 keep: Keep | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir, self.every_steps, self.every_seconds = run_dir, every_steps, every_seconds
        self.keep_at = sorted(int(x) for x in keep_at)
        self.keep = keep
        self.clock = clock
        self.last_save = clock()
        self.last_rows = clock()
        self.rows_written = 0
        """Rows already in the run's metrics parts."""
        self._examples = 0  # at the last boundary `due` looked at
        self._keep_for: list[int] = []  # the keep_at points the next checkpoint is taken for
        self.refused: str | None = None
        """Why this run takes no checkpoints (`resumable`), None when it does."""
        self._warned = False

    @property
    def folder(self) -> Path | None:
        return None if self.run_dir is None else RunPaths(self.run_dir).checkpoints

    # -- when -----------------------------------------------------------------------------

    def due(self, step: int, examples: int) -> bool:
        """Whether a checkpoint is due at the next step boundary, after `step` steps and
        `examples` examples (asked once a step)."""
        before, self._examples = self._examples, examples
        if self.refused is not None:
            return False
        crossed = [at for at in self.keep_at if before < at <= examples]
        if crossed:
            self._keep_for += crossed
            return True
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds and self.clock() - self.last_save >= self.every_seconds)

    # -- saving ---------------------------------------------------------------------------

    def flush_rows(self, state: TrainState, force: bool = False) -> bool:
        """The rows logged since the last flush as one more metrics part (rank 0), when
        `ROWS_EVERY_S` have passed or `force`. False when they could not be written (said
        once)."""
        if self.run_dir is None:
            return True
        if not force and self.clock() - self.last_rows < ROWS_EVERY_S:
            return True
        self.last_rows = self.clock()
        try:
            store.write_metrics_part(self.run_dir, state.rows, self.rows_written)
        except OSError as err:
            self._say_once(f"cannot write its rows ({_reason(err)}); they stay in memory and "
                           "are written later")
            return False
        self.rows_written = len(state.rows["step"])
        return True

    def save(self, state: TrainState) -> Checkpoint | None:
        """Save `state` (at a step boundary) as the run's latest checkpoint; every rank calls
        it. The rows go first: a checkpoint never stands ahead of its rows on disk. A save that
        fails (a full disk) is said once; the run goes on, and a resume starts from the
        previous checkpoint. Returns the checkpoint written (rank 0), else None."""
        if self.refused is not None:
            return None
        content = _whole_state(state)
        self.last_save = self.clock()
        if self.folder is None or not self.flush_rows(state, force=True):
            return None
        taken_for, self._keep_for = tuple(self._keep_for), []
        keep = bool(taken_for) or (self.keep is not None and self.keep(state.step,
                                                                       state.examples))
        ckpt = Checkpoint(self.folder / f"{state.step:012d}.pt", state.step, state.examples,
                          len(state.rows["step"]), keep, taken_for)
        # Who the checkpoint belongs to, inside it too: a .pt copied over another run's (its
        # sidecar's size and checksum forged to match) still names its own run.
        identity = {"run_id": self.folder.parent.name, "fingerprint": fingerprint(state),
                    "step": ckpt.step, "examples": ckpt.examples}
        buffer = io.BytesIO()
        torch.save({**content, IDENTITY: identity}, buffer)
        data = buffer.getbuffer()
        sidecar = {"format": FORMAT, **identity, "rows": ckpt.rows, "keep": keep,
                   "taken_for": list(taken_for), "size": len(data),
                   "sha256": hashlib.sha256(data).hexdigest(), "time": time.time()}
        try:
            store.subdir(self.folder.parent, self.folder)  # never through a link
            with store.atomic_path(ckpt.path) as tmp, open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            store.write_json(_sidecar(ckpt.path), sidecar)
        except OSError as err:
            ckpt.path.unlink(missing_ok=True)
            self._say_once(f"cannot write checkpoint {ckpt.path.name} ({_reason(err)}); going "
                           "on, a resume starts from the previous checkpoint")
            return None
        self._prune(ckpt)
        return ckpt

    def _prune(self, latest: Checkpoint) -> None:
        """Remove the checkpoints before `latest` that no one asked to keep."""
        for old in _listed(latest.path.parent):
            if old.step < latest.step and not old.keep:
                _remove(old.path)

    def finish(self) -> None:
        """The run has ended for good: its checkpoints go, but those asked to be kept."""
        if self.folder is None:
            return
        for old in _listed(self.folder):
            if not old.keep:
                _remove(old.path)
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # when none is kept

    def _say_once(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            name = self.run_dir.name if self.run_dir is not None else "?"
            print(f"gnsweep: run {name}: {what}", file=sys.stderr, flush=True)

    # -- resuming -------------------------------------------------------------------------

    def resume(self, state: TrainState) -> Checkpoint | None:
        """Continue `state` (freshly built) from the run's latest valid checkpoint, its rows
        read back from the run's metrics parts (those logged after it are dropped: the resumed
        run logs them again, alike). Without one, the run's rows on disk are cleared and it
        starts from step 0. Every rank calls it; rank 0 decides and tells the others."""
        found: Checkpoint | None = None
        rows: dict[str, list] | None = None
        content: dict[str, Any] | None = None  # rank 0's, read and verified once
        if self.run_dir is not None:
            self.refused = resumable(state)
            if self.refused is not None:
                self._say_once(self.refused)
            if self.refused is None:
                found, rows, content = self._latest(state)
            if found is None:
                store.clear_metrics(self.run_dir)
            if found is not None:
                print(f"gnsweep: run {self.run_dir.name}: continuing from its checkpoint at "
                      f"step {found.step}", file=sys.stderr, flush=True)
        found, rows, self.refused = _from_rank0([found, rows, self.refused], state.world)
        self.last_save = self.last_rows = self.clock()
        if found is None:
            return None
        if content is None:  # ranks > 0 read the file themselves
            content = verify(found.path, fingerprint(state))
        _load(state, content, found.path)
        assert rows is not None
        state.rows = rows
        self.rows_written = len(rows["step"])
        self._examples = state.examples
        return found

    def _latest(self, state: TrainState) -> tuple[Checkpoint | None, dict[str, list] | None,
                                                  dict[str, Any] | None]:
        """The newest checkpoint that belongs to this run, is whole and has its rows on disk,
        with those rows (the disk's rows cut at its step) and its content; bad ones said, one
        line each."""
        assert self.run_dir is not None and self.folder is not None
        mine = fingerprint(state)
        for ckpt in reversed(_listed(self.folder)):
            try:
                content = verify(ckpt.path, mine, run_id=self.run_dir.name)
            except StoreError as err:
                print(f"gnsweep: run {self.run_dir.name}: {err}; trying an earlier one",
                      file=sys.stderr, flush=True)
                continue
            rows = store.clear_metrics(self.run_dir, keep_through=ckpt.step)
            if len(rows["step"]) == ckpt.rows:
                return ckpt, rows, content
            print(f"gnsweep: run {self.run_dir.name}: checkpoint {ckpt.path.name} has "
                  f"{ckpt.rows} rows logged, {len(rows['step'])} on disk; trying an earlier one",
                  file=sys.stderr, flush=True)
        return None, None, None


def kept(run_dir: Path) -> list[tuple[int, Path]]:
    """A run's checkpoints on disk as (examples, .pt path), fewest examples first (unverified:
    `load_into` verifies the one chosen)."""
    return [(c.examples, c.path) for c in _listed(RunPaths(run_dir).checkpoints)]


def taken_for(run_dir: Path) -> dict[int, tuple[int, Path]]:
    """The run's checkpoints by the `keep_at` point each was taken for (examples asked, as in
    `train.keep_checkpoints_at`): (examples at the checkpoint, .pt path)."""
    return {point: (c.examples, c.path) for c in _listed(RunPaths(run_dir).checkpoints)
            for point in c.taken_for}


def verify(path: Path, fingerprint_: str | None = None, run_id: str | None = None
           ) -> dict[str, Any]:
    """The checkpoint's content, read once and checked against its sidecar: the size and
    sha256, the format, and (when given) the run's id and fingerprint. StoreError says what is
    wrong in one line."""
    meta = _read_sidecar(path)
    if meta.get("format") != FORMAT:
        raise StoreError(f"checkpoint {path.name}: format {meta.get('format')!r}, this version "
                         f"reads {FORMAT}")
    if run_id is not None and meta.get("run_id") != run_id:
        raise StoreError(f"checkpoint {path.name} belongs to run {meta.get('run_id')!r}, not "
                         f"{run_id}: refused")
    if fingerprint_ is not None and meta.get("fingerprint") != fingerprint_:
        raise StoreError(f"checkpoint {path.name} was taken under another configuration (grid "
                         "point, task options, world size or model): refused")
    data = _read_regular(path)
    if len(data) != meta.get("size"):
        raise StoreError(f"checkpoint {path.name} is {len(data)} bytes, its sidecar says "
                         f"{meta.get('size')}: truncated or overwritten")
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise StoreError(f"checkpoint {path.name} does not match its checksum: corrupt")
    try:
        content = dict(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))
    except Exception as err:  # a file that passed its checksum but torch cannot read
        raise StoreError(f"checkpoint {path.name}: unreadable ({type(err).__name__})") from None
    _check_identity(path, content, meta)
    return content


def _check_identity(path: Path, content: dict[str, Any], meta: dict[str, Any]) -> None:
    """The checkpoint's content names the run, fingerprint, step and examples its sidecar does
    (and the run's state stands at that step): a .pt copied over another's, its sidecar's
    size and checksum forged to match, is refused. A checkpoint written before the content
    named itself is held to its progress alone."""
    identity = content.pop(IDENTITY, None)
    progress = content.get("progress")
    if not isinstance(progress, dict) or (identity is not None and not isinstance(identity,
                                                                                 dict)):
        raise StoreError(f"checkpoint {path.name}: not a checkpoint of gnsweep: refused")
    checks = [(key, progress.get(key), meta.get(key)) for key in ("step", "examples")]
    if identity is not None:
        checks += [(key, identity.get(key), meta.get(key))
                   for key in ("run_id", "fingerprint", "step", "examples")]
    for key, found, wanted in checks:
        if found != wanted:
            found, wanted = (str(v)[:12] if key == "fingerprint" else repr(v)
                             for v in (found, wanted))
            raise StoreError(f"checkpoint {path.name}: its content names {key} {found} where "
                             f"its sidecar says {wanted}: copied from elsewhere, refused")


def load_into(state: TrainState, path: Path, fingerprint_: str | None = None) -> None:
    """Load the checkpoint at `path` (verified: size, checksum, and `fingerprint_` when given)
    into `state`, freshly built by `build_run`; this rank's own data position and random state
    where the checkpoint holds each rank's. The rows are not in a checkpoint: `state.rows` is
    left as it is (a branch starts its own)."""
    _load(state, verify(path, fingerprint_), path)


def _load(state: TrainState, content: dict[str, Any], path: Path) -> None:
    ranks = content.pop("ranks", None)
    if ranks is not None:
        if len(ranks) != state.world:
            raise StoreError(f"checkpoint {path.name} holds {len(ranks)} ranks, this run has "
                             f"{state.world}: refused")
        content.update(ranks[state.rank])
    rows = state.rows
    state.load_state_dict({**content, "rows": rows})


def _whole_state(state: TrainState) -> dict[str, Any]:
    """`state.state_dict()` without the rows; under torch.distributed with every rank's data
    position and random state (`ranks`), gathered from all ranks (a collective)."""
    rows, state.rows = state.rows, {}  # not copied: they stream to the metrics parts
    try:
        content = state.state_dict()
    finally:
        state.rows = rows
    content.pop("rows")
    if state.world > 1:
        local = {"data": content.pop("data"), "rng": content.pop("rng")}
        gathered: list[Any] = [None] * state.world
        torch.distributed.all_gather_object(gathered, local)
        content["ranks"] = gathered
    return content


def _from_rank0(values: list[Any], world: int) -> list[Any]:
    if world > 1:
        torch.distributed.broadcast_object_list(values, src=0)
    return values


def _listed(folder: Path) -> list[Checkpoint]:
    """The checkpoints with a sidecar, oldest first (unverified)."""
    out = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = folder / f"{name[:-len('.json')]}.pt"
        try:
            meta = _read_sidecar(path)
            out.append(Checkpoint(path, int(meta["step"]), int(meta["examples"]),
                                  int(meta["rows"]), bool(meta.get("keep", False)),
                                  tuple(int(n) for n in meta.get("taken_for", ()))))
        except (StoreError, KeyError, TypeError, ValueError):
            print(f"gnsweep: {folder / name}: not a checkpoint sidecar; ignored", file=sys.stderr)
    return sorted(out, key=lambda c: c.step)


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(_read_regular(_sidecar(path)))
    except (ValueError, UnicodeDecodeError) as err:
        raise StoreError(f"checkpoint {path.name}: its sidecar is not JSON ({err})") from None
    if not isinstance(meta, dict):
        raise StoreError(f"checkpoint {path.name}: its sidecar is not a JSON object")
    return meta


def _read_regular(path: Path) -> bytes:
    """The bytes of a regular file, never through a symbolic link (the folder may be shared)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise StoreError(f"{path.name}: missing") from None
    except OSError as err:
        raise StoreError(f"{path.name}: cannot open ({_reason(err)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{path.name}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    # The sidecar first: a .pt without one is never read.
    _sidecar(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _reason(err: OSError) -> str:
    return err.strerror or (str(err).splitlines() or [type(err).__name__])[0]
