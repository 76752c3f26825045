"""Atomic file output and (gzipped) JSON documents with a schema name and version."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from acstudio.errors import ProfileFileError, WrongSchemaError


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only if the block succeeds."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions
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
        raise ProfileFileError(f"{p}: no such file")
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
        raise ProfileFileError(f"{p}: not a readable {schema} file ({str(exc)[:80]})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise WrongSchemaError(f"{p}: expected a {schema} file, found {found!r}", found)
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
