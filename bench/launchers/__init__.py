"""Ways to run a job somewhere other than this process.

- :mod:`bench.launchers.docker`: the same job inside the CPU image (``containers/``), results
  folder mounted, no network, non-root; ``launcher=docker`` or ``python -m bench.launchers.docker``.
"""
