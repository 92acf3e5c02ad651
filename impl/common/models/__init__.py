"""Tiny real models built from workload shapes (for real-mode runs and equality tests)."""
