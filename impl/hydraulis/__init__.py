"""Hydraulis (arXiv 2412.07894): per-step heterogeneous parallel strategies and two-stage data assignment."""
