"""Exceptions turned into the one line a record, a log or a CLI error shows."""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the offending field."""


class NotApplicable(ConfigError):
    """A well-typed job its system refuses in preflight (``System.check``): the situation is one
    this system cannot run (a fault it does not model, a workload kind it does not train). The
    record marks it ``not_applicable``; a preset with ``not_applicable_ok: true`` (the cross-paper
    presets) keeps its sweep going and its tables show the line as 'not applicable'."""


def first_line(exc: BaseException) -> str:
    """The message's first line (the type's name when the message is empty): for a message
    that is already worded for the user, e.g. a library's error inside our own sentence."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``Type: message`` with all its lines joined (a ConfigError's text as it is: it already
    names the field), for a record's ``error`` or a warning."""
    text = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__
