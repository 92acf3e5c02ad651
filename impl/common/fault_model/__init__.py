"""What a fault is and what it does at an iteration: the typed specs and the pure functions that
the simulator and the real runtime both evaluate. It lives below ``faults`` (which adds the
sim-only injectors and re-exports these) so the runtime never imports the layer above it."""
