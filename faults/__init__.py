"""Fault and straggler specs, and the injectors that apply one spec to both modes."""
