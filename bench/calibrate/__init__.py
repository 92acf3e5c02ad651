"""``system=harness/calibrate``: the harness measures the machine it runs on and writes
``conf/hardware/local.yaml`` (:mod:`.system`; collectives in :mod:`.comm`). One of the harness's own
two systems, beside :mod:`bench.fidelity` (real vs sim on this machine): neither reproduces a paper,
so both live in ``bench/`` and the paper systems in ``impl/<paper>/``."""
