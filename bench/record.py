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
from typing import Any, Iterator

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
