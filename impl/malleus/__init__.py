"""Malleus (SIGMOD'25): straggler-aware malleable hybrid-parallel planning and live migration."""
