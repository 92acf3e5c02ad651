"""Simulator fidelity: the sim against real runs, per family (system=harness/fidelity, the store that
sim records' provenance reads, and the ``mlsys-bench-compare --fidelity`` view)."""
