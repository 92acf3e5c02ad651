"""`mlsys-bench`: the Hydra entry point.

Before Hydra starts, the overrides are composed and typed once (every combination of a sweep),
so a wrong key or value fails in one line naming it, before any job runs. With no arguments the
embedded default plan runs (see :mod:`bench.default_plan`).
"""
from __future__ import annotations

import itertools
import sys
from typing import Optional

import hydra
from omegaconf import DictConfig

from bench.config import register
from bench.system_choice import apply_choice, apply_hydra_choice, flat_choice_error, identity_overrides

register()

CONFIG_PATH = "pkg://conf"
CONFIG_NAME = "config"
# Hydra flags after which our preflight steps aside (they print, or change where configs live).
_PASSTHROUGH_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc",
                      "--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--version",
                      "--experimental-rerun", "--resolve", "--package", "-p"}
_FLAGS_WITHOUT_VALUE = {"--multirun", "-m", "--run", "-r"}
MAX_PREFLIGHT_COMBINATIONS = 256


def _describe(exc: BaseException, override_hint: str = "") -> str:
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException):
        options = getattr(exc, "options", None) or []
        missing = getattr(exc, "missing_cfg_file", "") or ""
        parts = str(missing).split("/")
        cut = 2 if parts[0] == "hydra" else 1  # hydra/launcher=..., else system=, experiment=...
        group, name = "/".join(parts[:cut]), "/".join(parts[cut:])
        if group and name:
            avail = ", ".join(_group_options(group)) or ", ".join(sorted(options)) or "none"
            return f"{group}={name}: no such {group} (available: {avail})"
    # Hydra's messages spread one fact over several lines; keep the facts, drop the advice
    # and the object dump.
    parts = []
    for line in str(exc).splitlines():
        line = " ".join(line.split())
        if not line or line.startswith(("To append", "full_key", "object_type", "reference_type")):
            continue
        parts.append(line.rstrip("."))
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        first = " ".join(str(cause).splitlines()[0].split()).rstrip(".")
        if first and first not in parts:
            parts.append(first)
    return ": ".join(parts) or type(exc).__name__


def _group_options(group: str) -> list[str]:
    """Every option of a group in the package's conf, nested ones as ``sub/name``."""
    from importlib import resources

    if group.startswith("hydra"):
        return []  # Hydra's own groups: the exception's option list is right for them
    root = resources.files("conf").joinpath(group)
    if not root.is_dir():
        return []
    out: list[str] = []

    def walk(node, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".yaml"):
                out.append(prefix + entry.name[:-5])

    walk(root, "")
    return sorted(out)


def _expand(overrides: list[str]) -> list[list[str]]:
    """All concrete override lists of a sweep (choice and range sweeps), capped."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes: list[list[str]] = []
    for ov in parsed:
        if ov.is_sweep_override():
            try:
                values = list(ov.sweep_string_iterator())
            except Exception:  # interval/glob sweeps: let Hydra expand them
                values = []
            prefix = ov.get_key_element()
            axes.append([f"{prefix}={v}" for v in values] or [])
        else:
            axes.append([ov.input_line])
    axes = [a for a in axes if a]
    combos = []
    for combo in itertools.product(*axes):
        combos.append(list(combo))
        if len(combos) >= MAX_PREFLIGHT_COMBINATIONS:
            break
    return combos or [[]]


def preflight(argv: list[str]) -> Optional[str]:
    """Compose and type every job of the command line; return an error line or None."""
    if any(a.split("=")[0] in _PASSTHROUGH_FLAGS for a in argv):
        return None
    overrides = [a for a in argv if a not in _FLAGS_WITHOUT_VALUE]
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from bench.hinges import apply_point
    from bench.validate import typed_job
    from impl.common.api import ConfigError, NotApplicable

    try:
        combos = _expand(overrides)
    except Exception as exc:
        return f"cannot parse overrides: {_describe(exc)}"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            for combo in combos:
                try:
                    cfg = apply_hydra_choice(compose(config_name=CONFIG_NAME, overrides=combo,
                                                     return_hydra_config=True))
                    apply_point(cfg)
                    typed_job(cfg)
                except NotApplicable as exc:
                    if not cfg.get("not_applicable_ok"):  # else: the job's record says not applicable
                        return str(exc)
                except ConfigError as exc:
                    return str(exc)
                except Exception as exc:
                    return _describe(exc)
    finally:
        GlobalHydra.instance().clear()
    return None


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
def _hydra_job(cfg: DictConfig) -> Optional[float]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from bench.runner import execute
    from bench.summary import print_record
    from impl.common.runtime.launch import is_primary

    hc = HydraConfig.get()
    apply_choice(cfg, hc.runtime.choices.get("system"))
    overrides = list(hc.overrides.task)
    sweep = str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    if str(cfg.launcher.value if hasattr(cfg.launcher, "value") else cfg.launcher) == "docker":
        from bench.launchers.docker import run_in_container

        inner = [o for o in overrides if not o.startswith("launcher=")]
        # The launcher streams the container's own output, summaries included.
        run = run_in_container(inner, cfg.results_dir, image=str(cfg.container_image))
        if run.exit_code != 0 and sweep is None:
            sys.exit(1)
        return None
    record = execute(cfg, overrides, sweep=sweep)
    if not is_primary():  # torchrun: global rank 0 speaks for the job
        if record["status"] == "failed" and sweep is None:
            sys.exit(1)
        return None
    print_record(record)
    if record["status"] == "failed" and sweep is None:
        sys.exit(1)
    return None


def _own_conf_first() -> None:
    """Make ``import conf`` find this project's configs, not a ``conf/`` folder that happens
    to sit in the working directory (``python -m`` puts the working directory first)."""
    import importlib
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parent.parent)
    mod = sys.modules.get("conf")
    if mod is not None and not str(getattr(mod, "__file__", "") or "").startswith(root):
        del sys.modules["conf"]
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)
        importlib.invalidate_caches()


def _secondary_rank_dirs() -> list[str]:
    """Under torchrun, ranks other than 0 keep Hydra's own output (job log) out of results_dir."""
    from impl.common.runtime.launch import is_primary

    if is_primary():
        return []
    import atexit
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="mlsys-bench-hydra-")
    atexit.register(shutil.rmtree, scratch, True)
    return [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}"]


def main(argv: Optional[list[str]] = None) -> None:
    import warnings

    _own_conf_first()
    # The ./conf search path entry is optional; its absence is not worth a warning.
    warnings.filterwarnings("ignore", message=r".*hydra\.searchpath in main, path=conf is not available.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        from bench.default_plan import run_default_plan

        sys.exit(run_default_plan())
    argv = identity_overrides(argv)
    error = flat_choice_error(argv) or preflight(argv)
    if error:
        print(f"mlsys-bench: error: {error}", file=sys.stderr)
        sys.exit(2)
    # argparse takes the overrides as one positional run: flags go first wherever they were typed.
    flags = [a for a in argv if a in _FLAGS_WITHOUT_VALUE]
    sys.argv = [sys.argv[0]] + flags + [a for a in argv if a not in _FLAGS_WITHOUT_VALUE] + _secondary_rank_dirs()
    _hydra_job()
    from bench.callbacks import SWEEP_FAILURES

    if SWEEP_FAILURES:  # the sweep went on past them; its exit status still says so
        sys.exit(1)


if __name__ == "__main__":
    main()
