"""Matplotlib figures shared by systems (Agg backend: no display needed)."""
