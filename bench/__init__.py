"""mlsys-bench harness: Hydra entry point, runners, record store, loggers, compare, gates."""
