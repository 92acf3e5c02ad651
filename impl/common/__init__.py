"""Substrate shared by several systems: cost models, simulator, schedule IR, runtime, builders."""
