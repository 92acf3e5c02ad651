"""Partition-agnostic checkpoints (spec ckpt_recovery 2.3-2.5): what to save or load is plain
data (:mod:`.layout`, :mod:`.plan`), how bytes move is :mod:`impl.common.storage`; the commit
protocol is :mod:`.store` and the resharded load :mod:`.reshard`."""
