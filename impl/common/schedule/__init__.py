"""Pipeline schedules as plain data: actions, per-stage lists, text form, validation."""
from .ir import Action, Op, Schedule, format_schedule, parse_schedule

__all__ = ["Action", "Op", "Schedule", "format_schedule", "parse_schedule"]
