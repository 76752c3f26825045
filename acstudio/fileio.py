"""Atomic file output and (gzipped) JSON documents with a schema name and version."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from acstudio.errors import ProfileFileError


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
    """Read a document written by :func:`write_document`; refuse other schemas and versions clearly."""
    p = Path(path)
    if not p.is_file():
        raise ProfileFileError(f"{p}: no such file")
    try:
        raw = p.read_bytes()
        text = gzip.decompress(raw).decode("utf-8") if raw[:2] == b"\x1f\x8b" else raw.decode("utf-8")
        doc = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError, gzip.BadGzipFile) as exc:
        raise ProfileFileError(f"{p}: not a readable {schema} file ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ProfileFileError(f"{p}: expected a {schema} file, found {found!r}")
    if doc.get("version") != version:
        raise ProfileFileError(
            f"{p}: {schema} version {doc.get('version')!r} is not supported (this AC Studio reads version "
            f"{version}); re-create it with this version"
        )
    return doc
