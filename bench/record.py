"""Result records: schema validation and crash-safe writes.

``record.json`` is written to a temp file and renamed, so a killed job never leaves half a
record. ``records.jsonl`` gets each record as one ``os.write`` of a full line on an
``O_APPEND`` descriptor, under a file lock, so concurrent multirun workers never interleave or
tear lines.
"""
from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import pathlib
import secrets
import tempfile
from importlib import resources
from typing import Any, Iterator, NamedTuple

import jsonschema
from filelock import FileLock

SCHEMA_ID = "mlsys-bench.record/1"
JSONL_NAME = "records.jsonl"


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(resources.files("bench").joinpath("schema/record-v1.json").read_text())


class RecordError(ValueError):
    pass


def validate(record: dict) -> None:
    """Raise RecordError naming the first field that breaks the schema."""
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        raise RecordError(f"record field {where}: {err.message}")


def new_run_id(system: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in system)
    return f"{stamp}-{safe}-{secrets.token_hex(3)}"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def created_key(rec: dict) -> tuple:
    """Sort key: oldest record first (``created``, then ``run_id``); an unreadable stamp sorts first."""
    text = rec.get("created") or ""
    try:
        stamp = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=_dt.timezone.utc)
        return (stamp.timestamp(), rec.get("run_id", ""))
    except ValueError:
        return (float("-inf"), rec.get("run_id", ""))


def _atomic_write_text(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes 0600; a record written in a container must stay readable on the host.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_record(results_dir: pathlib.Path | str, record: dict) -> pathlib.Path:
    """Validate, then write ``<results_dir>/<run_id>/record.json`` and append to records.jsonl."""
    validate(record)
    results_dir = pathlib.Path(results_dir)
    path = results_dir / record["run_id"] / "record.json"
    _atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
    jsonl = results_dir / JSONL_NAME
    with FileLock(str(jsonl) + ".lock"):
        fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write would tear the line: refuse loudly
                raise OSError(f"short append to {jsonl}: {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def iter_records(results_dir: pathlib.Path | str) -> Iterator[dict]:
    """Records under ``results_dir``: from records.jsonl, plus any record.json not in it.

    A malformed line raises with its line number rather than being skipped.
    """
    results_dir = pathlib.Path(results_dir)
    seen: set[str] = set()
    jsonl = results_dir / JSONL_NAME
    if jsonl.exists():
        with open(jsonl, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RecordError(f"{jsonl}:{lineno}: not valid JSON ({exc.msg})") from None
                seen.add(rec.get("run_id", ""))
                yield rec
    for path in sorted(results_dir.glob("*/record.json")):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}: not valid JSON ({exc.msg})") from None
        if rec.get("run_id") not in seen:
            yield rec


def load_records(results_dir: pathlib.Path | str) -> list[dict[str, Any]]:
    return list(iter_records(results_dir))


class Skipped(NamedTuple):
    """One piece of input a reader left out: ``where`` (file, or file:line) and why."""

    where: str
    why: str


class Scanned(NamedTuple):
    records: list[dict[str, Any]]
    sources: dict[str, str]  # run_id -> where it was read (file, or file:line)
    skipped: list[Skipped]


def scan_records(results_dir: pathlib.Path | str) -> Scanned:
    """Like :func:`load_records`, but a bad piece of input is skipped and listed, not raised:
    torn JSON, a foreign JSON document, an unknown schema version, a record the schema rejects.
    For readers that must show what they could read (the report), never for comparisons that
    would silently drop a record (``mlsys-bench-compare`` fails loudly instead)."""
    results_dir = pathlib.Path(results_dir)
    out: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    skipped: list[Skipped] = []

    def take(text: str, where: str) -> None:
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            skipped.append(Skipped(where, f"not valid JSON ({exc.msg})"))
            return
        if not isinstance(rec, dict) or "schema" not in rec:
            skipped.append(Skipped(where, "not an mlsys-bench record (no `schema` field)"))
            return
        if rec["schema"] != SCHEMA_ID:
            skipped.append(Skipped(where, f"unknown schema version {rec['schema']!r} (this reader knows {SCHEMA_ID!r})"))
            return
        try:
            validate(rec)
        except RecordError as exc:
            skipped.append(Skipped(where, str(exc)))
            return
        if rec["run_id"] in sources:
            return  # the same record in records.jsonl and its record.json
        sources[rec["run_id"]] = where
        out.append(rec)

    jsonl = results_dir / JSONL_NAME
    if jsonl.exists():
        with open(jsonl, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    take(line, f"{jsonl}:{lineno}")
    for path in sorted(results_dir.glob("*/record.json")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            skipped.append(Skipped(str(path), f"cannot read ({exc.strerror or exc})"))
            continue
        take(text, str(path))
    return Scanned(out, sources, skipped)
