"""Variable-length training substrate (HotSPa, Hydraulis, LobRA): length distributions,
per-step sampling, packing into ``cu_seqlens`` micro-batches, grouping and DP assignment."""
from impl.common.varlen.lengths import LengthDist, commoncrawl, github, hotspa_cpu, load_histogram, preset
from impl.common.varlen.packing import (LengthGroup, MicroBatch, assign_dp, check_boundaries, check_packing,
                                        equal_count, greedy_pack, group_by_boundaries, hotspa_pack, largest_first,
                                        pad_to_max, padded_length)
from impl.common.varlen.sampling import LengthStream, StepBatch

__all__ = ["LengthDist", "commoncrawl", "github", "hotspa_cpu", "load_histogram", "preset", "LengthGroup",
           "MicroBatch", "assign_dp", "check_boundaries", "check_packing", "equal_count", "greedy_pack",
           "group_by_boundaries", "hotspa_pack", "largest_first", "pad_to_max", "padded_length",
           "LengthStream", "StepBatch"]
