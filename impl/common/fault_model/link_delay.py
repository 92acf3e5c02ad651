"""Link-delay injection: which per-message delay each pipeline link carries at an iteration.

One function serves both modes: the simulator prices messages with it and the real runtime
sleeps it before each send on the link.
"""
from __future__ import annotations

from impl.common.errors import ConfigError

Link = tuple[int, int]


def resolve_link(link, stages: int) -> Link:
    """``[i, i+1]`` (either order: a link is undirected); negative indices count from the last stage, so ``[-2, -1]`` is the last
    link whatever the depth (one fault preset serves 4- and 8-stage workloads)."""
    i, j = sorted(int(x) + stages if int(x) < 0 else int(x) for x in link)
    return i, j


def check_links(links, stages: int, where: str) -> None:
    for link in links:
        if len(link) != 2:
            raise ConfigError(f"{where}: link {list(link)} must be a pair [i, i+1]")
        i, j = resolve_link(link, stages)
        if j != i + 1 or not 0 <= i < stages - 1:
            raise ConfigError(f"{where}: link ({i}, {j}) does not exist in a {stages}-stage pipeline "
                              f"(links are (i, i+1) with 0 <= i < {stages - 1})")


def validate_link_delay(fault, stages: int) -> None:
    """One-line ConfigError for a delay on a link that does not exist, negative delays, bad ranges."""
    if getattr(fault, "kind", None) != "link_delay":
        return
    check_links(fault.links, stages, "fault.links")
    if fault.delay_s < 0:
        raise ConfigError(f"fault.delay_s must be >= 0 seconds, got {fault.delay_s}")
    if fault.stop_iter is not None and fault.stop_iter <= fault.start_iter:
        raise ConfigError(f"fault.stop_iter ({fault.stop_iter}) must be > fault.start_iter ({fault.start_iter})")
    if fault.detection not in ("oracle", "measured"):
        raise ConfigError(f"fault.detection: unknown value {fault.detection!r} (one of: oracle, measured)")
    last = -1
    for k, ev in enumerate(fault.trace):
        check_links(ev.links, stages, f"fault.trace[{k}].links")
        if ev.delay_s < 0:
            raise ConfigError(f"fault.trace[{k}].delay_s must be >= 0 seconds, got {ev.delay_s}")
        if ev.start_iter <= last:
            raise ConfigError(f"fault.trace[{k}].start_iter {ev.start_iter} must be after the previous event's ({last})")
        last = ev.start_iter
    for k, it in enumerate(fault.rnic_failure_iters):
        if it < 0:
            raise ConfigError(f"fault.rnic_failure_iters[{k}] must be >= 0, got {it}")


def link_delays_at(fault, iteration: int, stages: int) -> dict[Link, float]:
    """``{(i, i+1): seconds}`` in force at ``iteration`` (empty when no delay applies).

    A non-empty ``trace`` replaces links/delay_s: the last event with start_iter <= iteration
    holds until the next one. ``start_iter``/``stop_iter`` (exclusive) bound the whole fault.
    """
    if getattr(fault, "kind", None) != "link_delay":
        return {}
    validate_link_delay(fault, stages)
    if iteration < fault.start_iter or (fault.stop_iter is not None and iteration >= fault.stop_iter):
        return {}
    links, delay_s = fault.links, fault.delay_s
    if fault.trace:
        current = [ev for ev in fault.trace if ev.start_iter <= iteration]
        if not current:
            return {}
        links, delay_s = current[-1].links, current[-1].delay_s
    return {resolve_link(link, stages): float(delay_s) for link in links} if delay_s > 0 else {}
