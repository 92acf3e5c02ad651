"""Partition-agnostic checkpoints in the format of Elastor's reference code (PKU-DAIR/Hetu PR #9):
what to save or load is plain data (:mod:`.layout`, :mod:`.plan`), how bytes move is
:mod:`impl.common.storage`; the commit protocol is :mod:`.store` and the resharded load
:mod:`.reshard`."""
