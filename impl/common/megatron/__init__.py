"""The Megatron-LM step model shared by every Megatron-like baseline: the model and layout
(:mod:`.model`), time and memory of one iteration (:mod:`.step`), measured launches
(:mod:`.runs`) and the fit of a hardware profile's knobs to them (:mod:`.fit`)."""
from .model import MegatronLayout, MegatronModel, padded_vocab
from .step import MicroBatchWork, StepEstimate, features, pack_work, pad_work, price, work_from_microbatches

__all__ = ["MegatronLayout", "MegatronModel", "MicroBatchWork", "StepEstimate", "features", "pack_work",
           "pad_work", "padded_vocab", "price", "work_from_microbatches"]
