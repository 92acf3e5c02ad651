"""Commit protocol of a checkpoint directory (Elastor's save path, made atomic; the kill points
the tests enumerate are listed in impl/ckpt_recovery/README.md, "Pieces").

CheckpointLayout on disk::

    root/step.txt                 pointer: "step00000012" (replaced by tmp + fsync + rename)
    root/step00000012/            a committed checkpoint (exists only with its manifest)
        manifest.json             files, sizes, sha256 (file, header, every key), layout, S,
                                  consumed_samples, RNG and scheduler state
        rank00000.safetensors ...
    root/.tmp-step00000014/       a save in progress (ranks write here, rank 0 renames it)

A save: rank 0 :meth:`begin` (never into an existing directory), barrier, every rank
:meth:`write_rank` (file and a JSON sidecar with its sizes and hashes, fsynced), barrier, rank 0
:meth:`commit`: manifest (fsynced) -> rename tmp -> step dir (fsync root) -> pointer -> rotate
(the oldest of ``keep`` copies goes only after the new pointer is durable; its manifest is
unlinked first, so a half-deleted copy is never taken for a committed one).

``kill`` is called at every named kill point (:data:`KILL_POINTS`); tests raise there to
emulate a SIGKILL, the recovery experiment sends a real one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from impl.common.storage.emulator import Storage, fsync_dir

from .fileformat import CheckpointError, WriteItem, parse_header, serialize, sha256
from .layout import CheckpointLayout, TensorMeta

FORMAT = "elastor-splits/1"
POINTER = "step.txt"
_STEP = re.compile(r"^step(\d{8})$")


def kill_points(world: int) -> list[str]:
    """Every point of a save at which a crash is tested, in the order a save passes them."""
    pts = []
    for r in range(world):
        pts += [f"before_write:{r}", f"mid_write:{r}", f"after_write:{r}"]
    return pts + ["after_barrier", "after_manifest", "after_rename", "mid_pointer", "after_pointer_tmp",
                  "after_pointer", "mid_rotation", "after_rotation"]


def step_name(step: int) -> str:
    return f"step{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class Checkpoint:
    """A committed checkpoint's manifest, opened (no tensor bytes read yet)."""

    root: str
    step: int
    manifest: dict

    @property
    def dir(self) -> str:
        return os.path.join(self.root, step_name(self.step))

    @property
    def splits(self) -> int:
        return int(self.manifest["splits"])

    @property
    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.from_dict(d) for d in self.manifest["tensors"]]

    @property
    def layout(self) -> CheckpointLayout:
        return CheckpointLayout.from_dict(self.manifest["layout"])

    @property
    def extra(self) -> dict:
        return self.manifest["extra"]

    def check_model(self, metas: Sequence[TensorMeta]) -> None:
        """The model being restored has the checkpoint's tensors, shapes and dtypes."""
        mine = {m.name: m for m in self.metas}
        want = {m.name: m for m in metas}
        for k in want:
            if k not in mine:
                raise CheckpointError(f"{self.dir}: checkpoint has no tensor {k} (another model?)")
            a, b = mine[k], want[k]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise CheckpointError(f"{self.dir}: tensor {k} is {a.dtype}{list(a.shape)} in the checkpoint, "
                                      f"the model expects {b.dtype}{list(b.shape)}")
        extra = sorted(set(mine) - set(want))
        if extra:
            raise CheckpointError(f"{self.dir}: checkpoint has {len(extra)} tensors the model lacks, e.g. {extra[0]}")


class CheckpointStore:
    def __init__(self, root: str, storage: Optional[Storage] = None, keep: int = 2,
                 kill: Optional[Callable[[str], None]] = None) -> None:
        if keep < 1:
            raise CheckpointError(f"checkpoint.keep: must be >= 1, got {keep}")
        self.root = str(root)
        self.storage = storage or Storage()
        self.keep = keep
        self.kill = kill or (lambda point: None)
        os.makedirs(self.root, exist_ok=True)

    def tmp_dir(self, step: int) -> str:
        return os.path.join(self.root, ".tmp-" + step_name(step))

    # ---- save --------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Rank 0, before the first barrier: a fresh temp dir; stale temp dirs of crashed saves go."""
        final = os.path.join(self.root, step_name(step))
        if os.path.exists(final):
            raise CheckpointError(f"{final}: already exists; a checkpoint is never saved into an existing directory")
        self.clear_stale()
        os.makedirs(self.tmp_dir(step))
        fsync_dir(self.root)

    def clear_stale(self) -> None:
        """Remove the temp dirs of crashed saves (rank 0, while no save is in flight: at a
        begin, or when a job restarts before its savers' first write; a stale temp dir may
        hold a half-written manifest that a later save of the same step must not meet)."""
        for d in os.listdir(self.root) if os.path.isdir(self.root) else ():
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    def write_rank(self, step: int, rank: int, items: Sequence[WriteItem], order: dict[str, int],
                   mirror: Optional[Callable[[str, memoryview], None]] = None) -> dict:
        """This rank's file and sidecar in the temp dir, both fsynced; returns the file record.
        ``mirror(name, bytes)`` gets the serialised file first (the peer tier's staging)."""
        self.kill(f"before_write:{rank}")
        data, keys = serialize(items, order)
        name = rank_file(rank)
        tmp = self.tmp_dir(step)
        path = os.path.join(tmp, name)
        side = os.path.join(tmp, f"rank{rank:05d}.json")
        # Async savers start without a begin(): the dir may exist, and hold this rank's files
        # from an attempt that crashed; each rank replaces only its own.
        os.makedirs(tmp, exist_ok=True)
        for stale in (path, side):
            if os.path.exists(stale):
                os.unlink(stale)
        hdr_len = 8 + int.from_bytes(data[:8], "little")
        _, entries = parse_header(data[:hdr_len], name, len(data))
        view = memoryview(data)
        if mirror is not None:
            mirror(name, view)
        rec = {"file": name, "rank": rank, "size": len(data), "sha256": sha256(view),
               "header_sha256": sha256(view[:hdr_len]),
               "keys": {k: [nm, j, sha256(view[entries[k].offset:entries[k].offset + entries[k].length])]
                        for k, (nm, j) in keys.items()}}
        self.storage.write_file(path, view, midway=lambda: self.kill(f"mid_write:{rank}"))
        self.storage.write_file(side, json.dumps(rec).encode())
        fsync_dir(tmp)
        self.kill(f"after_write:{rank}")
        return rec

    def read_sidecars(self, step: int, world: int) -> list[dict]:
        tmp = self.tmp_dir(step)
        out = []
        for r in range(world):
            p = os.path.join(tmp, f"rank{r:05d}.json")
            if os.path.exists(p):
                out.append(json.loads(self.storage.read_file(p)))
        return out

    def commit(self, step: int, records: Sequence[dict], metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int,
               extra: dict) -> str:
        """Rank 0, after every rank's write and a barrier. Returns the committed dir."""
        self.kill("after_barrier")
        tmp, final = self.tmp_dir(step), os.path.join(self.root, step_name(step))
        manifest = {"format": FORMAT, "step": step, "splits": S, "tensors": [m.to_dict() for m in metas],
                    "layout": layout.to_dict(), "files": {r["file"]: r for r in sorted(records, key=lambda r: r["rank"])},
                    "extra": extra}
        self.storage.write_file(os.path.join(tmp, "manifest.json"), json.dumps(manifest).encode())
        fsync_dir(tmp)
        self.kill("after_manifest")
        os.rename(tmp, final)
        fsync_dir(self.root)
        self.kill("after_rename")
        self._write_pointer(step)
        self.kill("after_pointer")
        self._rotate(step)
        for d in os.listdir(self.root):  # temp dirs of crashed saves
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
        self.kill("after_rotation")
        return final

    def _write_pointer(self, step: int) -> None:
        tmp = os.path.join(self.root, POINTER + ".tmp")
        if os.path.exists(tmp):
            os.unlink(tmp)
        data = (step_name(step) + "\n").encode()
        with open(tmp, "xb") as f:
            f.write(data[:5])
            f.flush()
            self.kill("mid_pointer")
            f.write(data[5:])
            f.flush()
            os.fsync(f.fileno())
        self.storage.charge("write", 1, len(data))
        self.kill("after_pointer_tmp")
        os.replace(tmp, os.path.join(self.root, POINTER))
        fsync_dir(self.root)

    def _rotate(self, newest: int) -> None:
        old = [s for s in self.committed_steps() if s < newest]
        for s in old[:max(0, len(old) - (self.keep - 1))]:
            d = os.path.join(self.root, step_name(s))
            os.unlink(os.path.join(d, "manifest.json"))  # first: the copy stops counting as committed
            fsync_dir(d)
            self.kill("mid_rotation")
            shutil.rmtree(d)
        fsync_dir(self.root)

    # ---- load --------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        out = []
        for d in os.listdir(self.root):
            m = _STEP.match(d)
            if m and os.path.exists(os.path.join(self.root, d, "manifest.json")):
                out.append(int(m.group(1)))
        return sorted(out)

    def drop_unpointed(self) -> list[int]:
        """Remove committed dirs newer than the pointer (rank 0, at a restart, before any save):
        a commit killed between its rename and its pointer write left them; the pointer is the
        truth, and a resumed job will save those steps again. Returns the steps removed."""
        pointed = self.latest()
        gone = [s for s in self.committed_steps() if pointed is None or s > pointed]
        for s in gone:
            d = os.path.join(self.root, step_name(s))
            os.unlink(os.path.join(d, "manifest.json"))  # first: a half-deleted dir is never taken as committed
            shutil.rmtree(d)
        if gone:
            fsync_dir(self.root)
        return gone

    def latest(self) -> Optional[int]:
        p = os.path.join(self.root, POINTER)
        if not os.path.exists(p):
            return None
        txt = self.storage.read_file(p).decode(errors="replace").strip()
        m = _STEP.match(txt)
        if not m:
            raise CheckpointError(f"{p}: corrupt pointer {txt[:40]!r}")
        return int(m.group(1))

    def open(self, step: Optional[int] = None) -> Checkpoint:
        """The pointed (or the given) committed checkpoint; checks its manifest and that every
        file it names exists with its recorded size (no tensor bytes are read)."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"{self.root}: no committed checkpoint ({POINTER} missing)")
        d = os.path.join(self.root, step_name(step))
        mp = os.path.join(d, "manifest.json")
        if not os.path.exists(mp):
            raise CheckpointError(f"{mp}: missing (step {step} is not committed)")
        try:
            manifest = json.loads(self.storage.read_file(mp))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{mp}: corrupt manifest ({e.__class__.__name__})") from None
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise CheckpointError(f"{mp}: not a {FORMAT} manifest of step {step}")
        for name, rec in manifest["files"].items():
            p = os.path.join(d, name)
            if not os.path.exists(p):
                raise CheckpointError(f"{p}: missing (named by the manifest)")
            size = os.path.getsize(p)
            if size != rec["size"]:
                raise CheckpointError(f"{p}: truncated or rewritten ({size} bytes, manifest says {rec['size']})")
        return Checkpoint(self.root, step, manifest)

    def open_latest_valid(self) -> tuple[Checkpoint, list[str]]:
        """The newest checkpoint that opens, and one line per newer one that did not."""
        skipped = []
        pointed = self.latest()
        try:
            return self.open(pointed), skipped
        except CheckpointError as e:
            skipped.append(str(e))
        for s in reversed(self.committed_steps()):
            if s == pointed:
                continue
            try:
                return self.open(s), skipped
            except CheckpointError as e:
                skipped.append(str(e))
        raise CheckpointError(f"{self.root}: no loadable checkpoint ({'; '.join(skipped)})")

    def verify_files(self, ck: Checkpoint) -> None:
        """Whole-file sha256 of every file (reads everything; the resharded load checks only
        the keys it reads)."""
        for name, rec in ck.manifest["files"].items():
            p = os.path.join(ck.dir, name)
            if sha256(self.storage.read_file(p)) != rec["sha256"]:
                raise CheckpointError(f"{p}: checksum mismatch (sha256 differs from the manifest)")
