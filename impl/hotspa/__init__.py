"""HotSPa (SOSP'24): parallelism hot switching by sequence-length group within one step."""
