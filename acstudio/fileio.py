"""Safe file output: what an output may replace (one policy for every command), atomic writes, and (gzipped)
JSON documents with a schema name and version."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acstudio.errors import OutputPathError, ProfileFileError, WrongSchemaError


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_writable(folder: Path) -> bool:
    """Create and remove a file in ``folder``: the only test that holds for root, read-only mounts and ACLs."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".acstudio-probe.", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def _check_place(target: Path, place: Path) -> None:
    if not place.is_dir():
        raise OutputPathError(f"cannot write {target}: {place} is not a folder — give a path under a folder")
    if not _probe_writable(place):
        raise OutputPathError(f"cannot write {target}: the folder {place} is not writable — choose another "
                              "location or change its permissions")


# -- what an output may replace ----------------------------------------------------------------------------
# Every command names its outputs and inputs here before any work. An output path may be new, or an earlier
# output of the same kind; anything else is refused naming what was found, and no output may be, or hold, an
# input of the same command. Paths are compared resolved (symlinks followed) and by identity (hard links).


@dataclass(frozen=True)
class FileKind:
    """A kind of output file, and how an earlier one is told from a user's file of the same name."""

    name: str  # in messages: "profile", "plan", "sweep table"
    recognise: Callable[[Path], bool]


def document_kind(name: str, schema: str) -> FileKind:
    """A document of ``schema`` written by :func:`write_document` (gzipped or not)."""
    return FileKind(name, lambda path: _head_schema(path) == schema)


def csv_kind(name: str, header: str) -> FileKind:
    """A CSV table whose first line starts with ``header``."""
    return FileKind(name, lambda path: _file_head(path).startswith(header.encode()))


def json_kind(name: str, keys: frozenset[str]) -> FileKind:
    """A JSON object that has every one of ``keys``."""

    def recognise(path: Path) -> bool:
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(doc, dict) and keys <= doc.keys()

    return FileKind(name, recognise)


def png_kind(name: str, maker: str = "Matplotlib") -> FileKind:
    """A PNG image whose metadata names ``maker`` (matplotlib names itself; the app's screenshots say AC Studio)."""

    def recognise(path: Path) -> bool:
        head = _file_head(path)
        return head.startswith(b"\x89PNG") and maker.encode() in head

    return FileKind(name, recognise)


@dataclass(frozen=True)
class FolderKind:
    """A kind of output folder.

    ``files``: the files written into it, each new or an earlier output of its kind; the folder may hold
    anything else. ``contents``, for a folder that is AC Studio's alone: the entries an earlier output of this
    kind holds, or ``None`` when the folder is not one; then an existing folder must be empty or such an output
    holding nothing else. ``replaced``: the folder is written as a whole, so nothing in it may be an input.
    ``fresh``: the writer fills the folder step by step and its parts refuse to overwrite each other, so an earlier
    output is set aside while it runs and dropped only once it succeeds (put back if it fails).
    """

    name: str
    files: Mapping[str, FileKind] = field(default_factory=dict)
    contents: Callable[[Path], frozenset[str] | None] | None = None
    replaced: bool = False
    fresh: bool = False


OutputKind = FileKind | FolderKind


def earlier_output_or_new(path: str | os.PathLike, kind: FolderKind) -> bool:
    """Whether writing the folder ``path`` as a whole loses nothing: it is absent, empty, or an earlier output
    of ``kind`` that holds nothing else."""
    target = Path(path)
    if not target.is_dir():
        return not target.exists()
    entries = {p.name for p in target.iterdir()}
    earlier = kind.contents(target) if kind.contents is not None else None
    return not entries or (earlier is not None and entries <= earlier)


def check_output(path: str | os.PathLike, kind: OutputKind, *, inputs: Iterable[str | os.PathLike] = (),
                 force: bool = False) -> None:
    """Refuse, in one line naming what was found, an output that would destroy anything but an earlier output
    of ``kind``, or that is (or holds) one of ``inputs``; also one that cannot be written. Call it before any
    work. ``force`` lets an earlier output of an AC Studio-only folder kind be replaced with what else it
    holds; never an input, never a folder AC Studio did not write."""
    Outputs(inputs, force=force).add(path, kind)


class Outputs:
    """The outputs of one command, checked against its inputs, each other and what is on disk before any work.

    ``with outputs.writing():`` around the writes re-checks them (another program may have written there in
    the meantime) and, if the block fails or is cancelled, removes every file and folder it created, so a
    failed command leaves nothing behind.
    """

    def __init__(self, inputs: Iterable[str | os.PathLike | None] = (), *, force: bool = False) -> None:
        self.inputs = [(str(p), _resolved(p)) for p in inputs if p is not None and str(p).strip()]
        self.force = force
        self.outputs: list[tuple[str, Path, OutputKind]] = []

    def add(self, path: str | os.PathLike | None, kind: OutputKind) -> Outputs:
        """Check one more output (``None``: the option was not given)."""
        if path is None:
            return self
        what = "folder" if isinstance(kind, FolderKind) else "file"
        if not str(path).strip():
            raise OutputPathError(f"the output {what} name is empty — give a path")
        target = _resolved(path)
        for name, earlier, earlier_kind in self.outputs:
            _refuse_overlap(str(path), target, kind, name, earlier, earlier_kind)
        self.outputs.append((str(path), target, kind))
        self._check(str(path), target, kind)
        return self

    def _check(self, name: str, target: Path, kind: OutputKind) -> None:
        if isinstance(kind, FileKind):
            self._check_file(name, target, kind)
            return
        if target.exists() and not target.is_dir():
            raise OutputPathError(f"{name} exists and is not a folder — give a folder name")
        if kind.contents is not None or kind.replaced:
            cwd = Path.cwd().resolve()
            if target == cwd or target in cwd.parents:
                raise OutputPathError(f"the output folder {name!r} holds the current folder and would be replaced "
                                      "as a whole — give a new folder name, e.g. --out exported/")
            for shown, source in self.inputs:
                if target == source or target in source.parents:
                    raise OutputPathError(f"the output folder {name} holds {shown}, an input of this command — "
                                          "give a new folder name")
        if kind.contents is not None and target.is_dir():
            self._check_own_folder(name, target, kind)
            _refuse_read_only(name, target)
        _check_place(target, target if target.is_dir() else _nearest_existing(target.parent))
        if kind.replaced:  # the new folder is made beside it
            _check_place(target, _nearest_existing(target.parent))
        for file_name, file_kind in kind.files.items():
            self._check_file(os.path.join(name, file_name), target / file_name, file_kind)

    def _check_own_folder(self, name: str, target: Path, kind: FolderKind) -> None:
        entries = sorted(p.name for p in target.iterdir())
        if not entries:
            return
        earlier = kind.contents(target)
        if earlier is None:
            raise OutputPathError(f"{name} is a folder AC Studio did not write (it holds {entries[0]}) — give a "
                                  f"new folder name for the {kind.name}")
        foreign = [e for e in entries if e not in earlier]
        if foreign and not self.force:
            raise OutputPathError(f"{name} is an earlier {kind.name} that also holds {foreign[0]}, which it did not "
                                  "write — move that out, give a new folder name, or --force to replace the folder "
                                  "with it")

    def _check_file(self, name: str, target: Path, kind: FileKind) -> None:
        for shown, source in self.inputs:
            if target == source or _same_file(target, source):
                raise OutputPathError(f"the output {name} is the input {shown} of this command — give another "
                                      "file name")
        if target.is_dir():
            raise OutputPathError(f"{name} is a folder — give a file name, e.g. {Path(name) / 'out.json'}")
        if target.exists() and not target.is_file():  # a device or a pipe: reading it to recognise it could block
            raise OutputPathError(f"{name} is not a regular file — give a file name")
        if target.exists() and not kind.recognise(target):
            raise OutputPathError(f"{name} exists and is not an earlier {kind.name} of AC Studio — give a new file "
                                  "name, or move that file")
        _refuse_read_only(name, target)
        _check_place(target, _nearest_existing(target.parent))

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Re-check the outputs, run the block, and on any failure remove what the block created."""
        for name, target, kind in self.outputs:
            self._check(name, target, kind)
        aside = [_set_aside(target) for _, target, kind in self.outputs
                 if isinstance(kind, FolderKind) and kind.fresh and target.is_dir() and any(target.iterdir())]
        undo = [_undo_for(target, kind) for _, target, kind in self.outputs]
        try:
            yield
        except BaseException:
            for step in undo:
                step()
            for target, kept in aside:
                if not target.exists():
                    kept.rename(target)
            raise
        for _, kept in aside:
            shutil.rmtree(kept, ignore_errors=True)


def _set_aside(target: Path) -> tuple[Path, Path]:
    """Move the folder ``target`` to a new unique name beside it; (target, where it went)."""
    kept = Path(tempfile.mkdtemp(prefix=f".{target.name}.earlier-", dir=target.parent))
    kept.rmdir()
    target.rename(kept)
    return target, kept


def _refuse_read_only(name: str, target: Path) -> None:
    """A file or folder its owner made read-only is kept, even by root (who could write it anyway)."""
    if target.exists() and not target.stat().st_mode & stat.S_IWUSR:
        raise OutputPathError(f"{name} is read-only — give a new name, or make it writable if it may be replaced")


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _claims(target: Path, kind: OutputKind) -> list[tuple[Path, str]]:
    """The paths an output writes: ``file``, ``folder`` (files go into it) or ``tree`` (all of it is ours)."""
    if isinstance(kind, FileKind):
        return [(target, "file")]
    whole = kind.replaced or kind.contents is not None
    return [(target, "tree" if whole else "folder"), *((target / f, "file") for f in kind.files)]


def _refuse_overlap(name: str, target: Path, kind: OutputKind, other: str, other_target: Path,
                    other_kind: OutputKind) -> None:
    for a, how_a in _claims(target, kind):
        for b, how_b in _claims(other_target, other_kind):
            clash = (a == b and not (how_a == how_b == "folder")) or \
                    (a in b.parents and how_a in ("file", "tree")) or (b in a.parents and how_b in ("file", "tree"))
            if clash:
                raise OutputPathError(f"the outputs {other} and {name} are the same path or one holds the other — "
                                      "give each its own name")


def _undo_for(target: Path, kind: OutputKind) -> Callable[[], None]:
    """A function that removes what will be created at ``target`` from now on: the files of ``kind``, a new
    folder, and for a folder that is AC Studio's alone everything new in it; what is there now stays."""
    anchor = _nearest_existing(target.parent)
    if not target.exists():
        def undo() -> None:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
            _remove_empty_parents(target, anchor)
        return undo
    if isinstance(kind, FileKind) or not target.is_dir():
        return lambda: None
    if kind.contents is None and not kind.replaced:
        new_files = [target / f for f in kind.files if not (target / f).exists()]

        def undo_new_files() -> None:
            for path in new_files:
                if not path.is_dir():
                    path.unlink(missing_ok=True)
        return undo_new_files
    existed = set(target.rglob("*"))

    def undo_new_entries() -> None:
        for path in sorted(target.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path not in existed:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
    return undo_new_entries


def _remove_empty_parents(target: Path, anchor: Path) -> None:
    """Remove the folders between ``target`` and ``anchor`` that are empty (created for ``target``)."""
    for parent in target.parents:
        if parent == anchor or anchor not in parent.parents:
            return
        try:
            parent.rmdir()
        except OSError:
            return


def _file_head(path: str | os.PathLike, size: int = 4096) -> bytes:
    """The first ``size`` bytes of a file (none if it cannot be read): enough to recognise a kind of file."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def _head_schema(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return _claimed_schema(f.read(1 << 16))
    except OSError:
        return None


# The outputs of the commands (an export folder is :data:`acstudio.export.exporter.EXPORT_FOLDER`).
PROFILE_FILE = document_kind("profile", "acstudio.profile")
PLAN_FILE = document_kind("plan", "acstudio.plan")
SWEEP_TABLE = csv_kind("sweep table", "solver,budget_bytes,peak_bytes")
VERIFY_RESULT = json_kind("verify result", frozenset({"passed", "comparisons", "recomputed"}))
PROFILE_TABLES = FolderKind("profile tables", files={"nodes.csv": csv_kind("node table", "id,name,op,target"),
                                                     "activations.csv": csv_kind("activation table", "id,bytes")})
SCHEDULE_FOLDER = FolderKind("schedule", files={
    "schedule.json": json_kind("schedule", frozenset({"profile_fingerprint", "solver", "schedule"})),
    "schedule.csv": csv_kind("schedule table", "activation,decision,bytes")})
PLOT_FOLDER = FolderKind("plots", files={name: png_kind("plot") for name in (
    "peak_vs_batch.png", "time_vs_batch.png", "memory_vs_overhead.png")})
BENCH_ENTRIES = frozenset({"bench.json", "bench.csv", "summary.md", "workers", "profiles"})


def _earlier_bench(folder: Path) -> frozenset[str] | None:
    """A benchmark folder is known by its ``bench.json``, or, cancelled before writing one, by holding only
    what a benchmark writes."""
    if _head_schema(folder / "bench.json") == "acstudio.bench":
        return BENCH_ENTRIES
    return BENCH_ENTRIES if {p.name for p in folder.iterdir()} <= BENCH_ENTRIES else None


BENCH_FOLDER = FolderKind("benchmark folder", contents=_earlier_bench, fresh=True)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only if the block succeeds.

    A symbolic link is written through (its target is replaced), so the link the user made stays."""
    target = _resolved(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike, before_replacing: Callable[[], None] = lambda: None) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; it replaces ``path`` as a whole only if the block succeeds.

    ``before_replacing`` runs just before the swap (to check once more that ``path`` may go). The folder being
    replaced is first moved into a new folder of a unique name, so nothing but this run's own moves is ever
    deleted, and it is put back if the swap fails.
    """
    target = _resolved(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders; give the usual permissions
    try:
        yield tmp
        before_replacing()
        if not target.exists():
            tmp.rename(target)
            return
        holder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        old = holder / target.name
        try:
            target.rename(old)
            tmp.rename(target)
        except BaseException:
            if old.exists() and not target.exists():
                old.rename(target)
            if not old.exists():
                holder.rmdir()
            raise
        shutil.rmtree(holder, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_document(path: str | os.PathLike, schema: str, version: int, body: dict[str, Any]) -> None:
    """Write ``{"schema", "version", **body}`` as JSON, gzipped when the name ends in ``.gz``."""
    data = json.dumps({"schema": schema, "version": version, **body}, separators=(",", ":"))
    with atomic_path(path) as tmp:
        if str(path).endswith(".gz"):
            with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
                f.write(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def read_document(path: str | os.PathLike, schema: str, version: int) -> dict[str, Any]:
    """Read a document written by :func:`write_document`; refuse other schemas and versions clearly.

    A document that cannot be parsed is reported by the schema its readable beginning names, so a truncated
    plan reads as a corrupt plan (and as "not a profile" where a profile was expected), not as garbage.
    """
    p = Path(path)
    if not p.is_file():
        raise ProfileFileError(f"{p}: no such file — check the path")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ProfileFileError(f"{p}: cannot read it ({exc.strerror or exc})") from exc
    try:
        text = gzip.decompress(raw).decode("utf-8") if raw[:2] == b"\x1f\x8b" else raw.decode("utf-8")
        doc = json.loads(text)
    except (EOFError, ValueError, RecursionError, gzip.BadGzipFile, zlib.error) as exc:
        claimed = _claimed_schema(raw)
        if claimed is not None and claimed != schema:
            raise WrongSchemaError(f"{p}: expected a {schema} file, found a damaged {claimed!r} file",
                                   claimed) from exc
        if claimed == schema:
            kind = schema.removeprefix("acstudio.")
            raise ProfileFileError(f"{p}: corrupt {kind}: the file is truncated or damaged "
                                   f"({type(exc).__name__}: {str(exc)[:80]}) — write it again") from exc
        raise ProfileFileError(f"{p}: not a readable {schema} file ({str(exc)[:80]}) — give a file AC Studio wrote")\
            from exc
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise WrongSchemaError(f"{p}: expected a {schema} file, found {found!r} — check the file name", found)
    if doc.get("version") != version:
        raise ProfileFileError(
            f"{p}: {schema} version {doc.get('version')!r} is not supported (this AC Studio reads version "
            f"{version}); re-create it with this version"
        )
    return doc


_SCHEMA_HEAD = re.compile(r'^\s*\{\s*"schema"\s*:\s*"([A-Za-z0-9_.]+)"')


def _claimed_schema(raw: bytes) -> str | None:
    """The schema named at the start of a (possibly truncated, possibly gzipped) document, if any."""
    head = raw[:4096]
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw, 4096)
        except zlib.error:
            return None
    match = _SCHEMA_HEAD.match(head.decode("utf-8", errors="replace"))
    return match.group(1) if match else None
