"""Atomic file output and (gzipped) JSON documents with a schema name and version."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
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


def check_writable(path: str | os.PathLike, *, folder: bool = False) -> None:
    """Refuse, before any work is done, an output path that cannot be written.

    ``folder=False``: ``path`` is a file (replaced atomically, so its folder must take new files);
    ``folder=True``: ``path`` is a folder that receives files. Missing parent folders are fine as long as
    they can be created. Nothing is left behind.
    """
    target = Path(path)
    what = "folder" if folder else "file"
    if not str(path).strip():
        raise OutputPathError(f"the output {what} name is empty — give a path")
    if not folder and target.is_dir():
        raise OutputPathError(f"{target} is a folder — give a file name, e.g. {target / 'out.json'}")
    if folder and target.exists() and not target.is_dir():
        raise OutputPathError(f"{target} exists and is not a folder — give a folder name")
    _check_place(target, target if target.is_dir() else _nearest_existing(target.parent))


def _check_place(target: Path, place: Path) -> None:
    if not place.is_dir():
        raise OutputPathError(f"cannot write {target}: {place} is not a folder — give a path under a folder")
    if not _probe_writable(place):
        raise OutputPathError(f"cannot write {target}: the folder {place} is not writable — choose another "
                              "location or change its permissions")


def prepare_output_dir(path: str | os.PathLike, *, force: bool = False,
                       markers: Mapping[str, str] = MappingProxyType({"manifest.json": "acstudio.export"})) -> None:
    """Refuse an output folder that :func:`atomic_dir` must not replace; call before doing any work.

    :func:`atomic_dir` replaces the folder as a whole, so an existing non-empty one is accepted only if it is
    ours (one of its ``markers`` files is a document of the schema named beside it) or ``force`` is given. The
    current folder and its ancestors are never replaced, even with ``force``. The folder's parent must take new
    entries.
    """
    target = Path(path)
    resolved = target.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise OutputPathError(f"the output folder {str(path)!r} holds the current folder and would be replaced "
                              "as a whole — give a new folder name, e.g. --out exported/")
    check_writable(target, folder=True)
    _check_place(target, _nearest_existing(resolved.parent))
    if force or replaceable_dir(target, markers):
        return
    raise OutputPathError(f"{target} is a non-empty folder that AC Studio did not write, and exporting replaces "
                          "the folder as a whole — give a new folder name, or --force to replace it")


def replaceable_dir(path: str | os.PathLike, markers: Mapping[str, str]) -> bool:
    """Whether writing ``path`` as a whole loses nothing: it is absent, empty, or one of its ``markers`` files is
    a document of the schema named beside it (an earlier output of ours)."""
    target = Path(path)
    if not target.is_dir() or not any(target.iterdir()):
        return True
    return any(_is_document(target / name, schema) for name, schema in markers.items())


def _is_document(path: Path, schema: str) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("schema") == schema
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only if the block succeeds."""
    target = Path(path)
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
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; it replaces ``path`` as a whole only if the block succeeds."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders; give the usual permissions
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
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
