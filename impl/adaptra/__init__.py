"""ADAPTRA / PipeMorph: straggler-resilient pipeline parallelism (arXiv 2504.19232, NSDI'26).

Files follow the paper's steps: Alg. 1 (initial warm-up plan) and Alg. 3/4 (the
list-scheduling simulation that turns warm-up quotas into per-stage op lists) are shared with
the ZB baseline and live in ``impl.common.schedule.warmup`` / ``.list_scheduler``; ADAPTRA's
own step is ``adapt.py`` (Alg. 2, slack adaptation to measured link delays), and
``builder.py`` chains the two. Schedules are plain data (``impl.common.schedule``);
simulating or executing them is done elsewhere.
"""
