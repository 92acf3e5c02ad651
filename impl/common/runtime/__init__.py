"""Real multi-process pipeline runtime: B/W split, comm paths, link delays, executor.

Submodules are imported explicitly (``from impl.common.runtime.executor import run_pipeline``)
so that importing the package stays cheap.
"""
