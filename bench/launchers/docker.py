"""Run one mlsys-bench job inside the container image (``containers/``).

``run_in_container(["system=harness/calibrate", "mode=real"], "results/runs")`` runs
``mlsys-bench system=harness/calibrate mode=real results_dir=/results`` in ``mlsys-bench:cpu`` with:

- the host ``results_dir`` bind-mounted read-write at ``/results``: records land in the same
  ``<results_dir>/<run_id>/record.json`` + ``records.jsonl`` as a local run;
- no network (``network_mode="none"``; ``"host"`` on request), all capabilities dropped,
  ``no-new-privileges``;
- the image's non-root user (uid 10001) with the host user's group, umask 002, so the host
  user can read, edit and delete what the container wrote;
- an environment made here from nothing: ``MLSYS_BENCH_CONTAINER_IMAGE=<image id>`` (the
  record's ``provenance.container_image``), ``WANDB_MODE=offline`` and, without a network,
  the Hugging Face offline switches. No host variable is passed through, so no secret can be.

It returns a :class:`ContainerRun` with the exit code, the logs, the image id and the records
the job appended. Problems with the engine or the image raise :class:`ContainerLaunchError`
with one line that says what to do.

CLI: ``python -m bench.launchers.docker [--image IMG] [--network none|host] [overrides...]``;
a ``results_dir=DIR`` override names the host folder to mount (default ``results/runs``).
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from impl.common.errors import first_line

DEFAULT_IMAGE = "mlsys-bench:cpu"
CONTAINER_UID = 10001
RESULTS_MOUNT = "/results"
DEFAULT_RESULTS_DIR = "results/runs"
BUILD_HINT = "containers/build_image.sh"
# Overrides the launcher owns: the inner job always writes to the mount, locally.
_OWNED_KEYS = ("results_dir", "launcher", "container_image")
# Under results_dir, the harness appends to these files and creates entries in these folders;
# they must be writable by the container user when they already exist on the host.
_SHARED_FILES = ("records.jsonl", "records.jsonl.lock")
_SHARED_DIRS = ("_hydra",)


class ContainerLaunchError(RuntimeError):
    """The job could not be started in a container; the message is one actionable line."""


class EngineUnavailable(ContainerLaunchError):
    pass


class ImageMissing(ContainerLaunchError):
    pass


@dataclass
class ContainerRun:
    exit_code: int
    logs: str                      # stdout and stderr, interleaved as the engine recorded them
    image: str                     # the reference asked for, e.g. "mlsys-bench:cpu"
    image_id: str                  # "sha256:..."; what provenance.container_image holds
    container_id: str
    command: list[str]             # arguments given to mlsys-bench inside the container
    results_dir: Path              # host folder mounted at /results
    user: str                      # as the engine ran it, e.g. "10001:1000"
    network: str                   # as the engine ran it, e.g. "none"
    duration_s: float
    timed_out: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)
    env: list[str] = field(default_factory=list)  # "K=V" as the engine ran it (image ENV + ours)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def record_paths(self) -> list[Path]:
        return [self.results_dir / str(r.get("run_id")) / "record.json" for r in self.records]


def _engine_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def client(timeout: int = 60):
    """A connected ``docker.DockerClient``, or :class:`EngineUnavailable`."""
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - docker is a project dependency
        raise EngineUnavailable(f"the docker python package is missing ({exc}): pip install docker") from None
    try:
        cli = docker.from_env(timeout=timeout)
        cli.ping()
    except Exception as exc:  # DockerException, requests errors: all mean "no engine here"
        raise EngineUnavailable(
            f"docker engine not reachable at {_engine_address()}: start dockerd "
            f"(e.g. `bash .ci/docker.sh`) or point DOCKER_HOST at a running engine ({first_line(exc)})"
        ) from None
    return cli


def engine_unavailable_reason() -> Optional[str]:
    """None when a docker engine answers, else the one-line reason (for skips and --help)."""
    try:
        client(timeout=10).close()
    except ContainerLaunchError as exc:
        return str(exc)
    return None


def image_id(image: str = DEFAULT_IMAGE, cli=None) -> str:
    """The id (``sha256:...``) of a local image, or :class:`ImageMissing`."""
    import docker

    cli = cli or client()
    try:
        return cli.images.get(image).id
    except docker.errors.ImageNotFound:
        raise ImageMissing(f"image {image} not found: build it with {BUILD_HINT}") from None
    except docker.errors.APIError as exc:
        raise ContainerLaunchError(f"cannot inspect image {image}: {first_line(exc)}") from None


def inner_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides for the job inside: the launcher's own keys dropped, results_dir=/results."""
    kept = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in _OWNED_KEYS:
            continue
        kept.append(o)
    return kept + [f"results_dir={RESULTS_MOUNT}"]


def _writable_by(st: os.stat_result, uid: int, gid: int) -> bool:
    mode = st.st_mode
    return bool((st.st_uid == uid and mode & stat.S_IWUSR)
                or (st.st_gid == gid and mode & stat.S_IWGRP)
                or mode & stat.S_IWOTH)


def prepare_results_dir(results_dir: Path, uid: int = CONTAINER_UID, gid: Optional[int] = None) -> None:
    """Create ``results_dir`` and make the places the job writes group-writable for ``gid``.

    The folder gets the setgid bit so everything created in it keeps the host user's group;
    ``records.jsonl`` (and its lock) are created here, owned by the host user. Raises
    :class:`ContainerLaunchError` when a place stays unwritable for ``uid:gid``.
    """
    gid = os.getgid() if gid is None else gid
    results_dir.mkdir(parents=True, exist_ok=True)
    for name in _SHARED_FILES:
        (results_dir / name).touch(exist_ok=True)
    targets = [results_dir] + [results_dir / d for d in _SHARED_DIRS] + [results_dir / f for f in _SHARED_FILES]
    for path in targets:
        if not path.exists():
            continue
        st = path.stat()
        is_dir = stat.S_ISDIR(st.st_mode)
        want = st.st_mode | (stat.S_IRWXG | stat.S_ISGID if is_dir else stat.S_IRGRP | stat.S_IWGRP)
        if st.st_uid == os.getuid() and stat.S_IMODE(want) != stat.S_IMODE(st.st_mode):
            try:
                os.chmod(path, stat.S_IMODE(want))
                st = path.stat()
            except OSError:
                pass
        if not _writable_by(st, uid, gid) or (is_dir and not (st.st_mode & (stat.S_IXGRP | stat.S_IXOTH))):
            raise ContainerLaunchError(
                f"{path} is not writable by the container user {uid}:{gid}: "
                f"`chmod g+rwX {path}` (with group {gid}) or choose another results_dir")


def _read_new_records(jsonl: Path, offset: int) -> list[dict[str, Any]]:
    if not jsonl.exists():
        return []
    with open(jsonl, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    records = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a killed job; the job's record.json is authoritative
    return records


def _pump(container, to_stdout: bool, sink: TextIO) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        for chunk in container.logs(stream=True, follow=True, stdout=to_stdout, stderr=not to_stdout):
            sink.write(decoder.decode(chunk))
            sink.flush()
        sink.write(decoder.decode(b"", final=True))
        sink.flush()
    except Exception:  # the container went away (timeout, interrupt): logs are collected later
        pass


def run_in_container(
    overrides: Sequence[str],
    results_dir: Path | str = DEFAULT_RESULTS_DIR,
    image: str = DEFAULT_IMAGE,
    network: str = "none",
    *,
    user: Optional[str] = None,
    stream: bool = True,
    timeout_s: Optional[float] = None,
    shm_size: str = "1g",
    init: bool = True,
) -> ContainerRun:
    """Run ``mlsys-bench <overrides> results_dir=/results`` in ``image``; see the module doc.

    ``user`` defaults to ``"10001:<host gid>"``. ``stream`` forwards the container's stdout and
    stderr to ours as they come. ``timeout_s`` kills the container after that long
    (``timed_out=True``, exit code 124). ``shm_size`` sizes /dev/shm for multi-process jobs.
    """
    import docker

    results_dir = Path(results_dir).expanduser().resolve()
    cli = client()
    try:
        img_id = image_id(image, cli)
        gid = os.getgid()
        user = user or f"{CONTAINER_UID}:{gid}"
        uid_part, _, gid_part = user.partition(":")
        if uid_part in ("0", "root"):
            raise ContainerLaunchError("refusing to run the job as root in the container: use a non-root user")
        prepare_results_dir(results_dir, uid=int(uid_part) if uid_part.isdigit() else CONTAINER_UID,
                            gid=int(gid_part) if gid_part.isdigit() else gid)
        jsonl = results_dir / _SHARED_FILES[0]
        offset = jsonl.stat().st_size if jsonl.exists() else 0

        command = inner_overrides(overrides)
        environment = {"MLSYS_BENCH_CONTAINER_IMAGE": img_id, "WANDB_MODE": "offline"}
        if network == "none":
            environment.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        start = time.monotonic()
        try:
            container = cli.containers.run(
                img_id,
                command=command,
                # umask 002: files the job writes stay editable by the host user's group.
                entrypoint=["/bin/sh", "-c", 'umask 0002 && exec mlsys-bench "$@"', "mlsys-bench"],
                detach=True,
                user=user,
                network_mode=network,
                environment=environment,
                volumes={str(results_dir): {"bind": RESULTS_MOUNT, "mode": "rw"}},
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                shm_size=shm_size,
                init=init,
                labels={"org.mlsys-bench.launcher": "docker", "org.mlsys-bench.image": image},
            )
        except docker.errors.APIError as exc:
            raise ContainerLaunchError(f"cannot start a container from {image}: {first_line(exc)}") from None

        pumps = []
        if stream:
            pumps = [threading.Thread(target=_pump, args=(container, out, sink), daemon=True)
                     for out, sink in ((True, sys.stdout), (False, sys.stderr))]
            for t in pumps:
                t.start()
        timed_out = False
        try:
            try:
                exit_code = int(container.wait(timeout=timeout_s)["StatusCode"])
            except Exception as exc:  # requests' ReadTimeout/ConnectionError on timeout
                if timeout_s is None:
                    raise ContainerLaunchError(f"lost the container {container.short_id}: {first_line(exc)}") from None
                timed_out, exit_code = True, 124
                container.kill()
                container.wait(timeout=30)
            for t in pumps:
                t.join(timeout=5)
            container.reload()
            logs = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
            ran_user = container.attrs["Config"].get("User") or ""
            ran_network = container.attrs["HostConfig"].get("NetworkMode") or ""
            ran_env = list(container.attrs["Config"].get("Env") or [])
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass
        if timed_out:
            msg = f"mlsys-bench (docker): killed after {timeout_s:g} s\n"
            logs += msg
            if stream:
                sys.stderr.write(msg)
        return ContainerRun(
            exit_code=exit_code, logs=logs, image=image, image_id=img_id, container_id=container.id,
            command=command, results_dir=results_dir, user=ran_user, network=ran_network,
            duration_s=time.monotonic() - start, timed_out=timed_out,
            records=_read_new_records(jsonl, offset), env=ran_env,
        )
    finally:
        cli.close()


def _repo_build_script() -> Optional[Path]:
    path = Path(__file__).resolve().parents[2] / "containers" / "build_image.sh"
    return path if path.exists() else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.launchers.docker",
        description="Run one mlsys-bench job inside the container image, results folder mounted. "
                    "Everything not listed below is passed to mlsys-bench as an override "
                    f"(results_dir=DIR names the host folder; default {DEFAULT_RESULTS_DIR}).",
    )
    parser.add_argument("--image", default=os.environ.get("MLSYS_BENCH_IMAGE", DEFAULT_IMAGE),
                        help=f"image to run (default {DEFAULT_IMAGE}, or $MLSYS_BENCH_IMAGE)")
    parser.add_argument("--network", default="none", help="none (default) or host")
    parser.add_argument("--user", default=None, help="uid[:gid] inside (default 10001:<your gid>)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="kill the job after S seconds")
    parser.add_argument("--build", action="store_true", help=f"run {BUILD_HINT} first (from a checkout)")
    parser.add_argument("--quiet", action="store_true", help="do not stream the container's output")
    args, overrides = parser.parse_known_args(argv)

    results_dir = DEFAULT_RESULTS_DIR
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "results_dir" and value:
            results_dir = value
    try:
        if args.build:
            script = _repo_build_script()
            if script is None:
                raise ContainerLaunchError(f"--build needs a source checkout ({BUILD_HINT} not found)")
            import subprocess

            env = {**os.environ, "IMAGE": args.image}
            if subprocess.run(["bash", str(script)], env=env, stdout=subprocess.DEVNULL).returncode != 0:
                raise ContainerLaunchError(f"{BUILD_HINT} failed (see its output above)")
        run = run_in_container(overrides, results_dir, image=args.image, network=args.network,
                               user=args.user, stream=not args.quiet, timeout_s=args.timeout)
    except ContainerLaunchError as exc:
        print(f"mlsys-bench (docker): error: {exc}", file=sys.stderr)
        return 2
    paths = ", ".join(str(p) for p in run.record_paths) or "no record"
    print(f"mlsys-bench (docker): exit {run.exit_code} in {run.duration_s:.1f} s, image {run.image} "
          f"({run.image_id[:19]}), user {run.user}, network {run.network}: {paths}", file=sys.stderr)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
