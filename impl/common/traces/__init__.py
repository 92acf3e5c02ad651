"""Request traces for LLM serving: generate -> validate -> save/load, as plain data."""
from .requests import (Trace, TraceRequest, TraceSpec, gamma_arrivals, generate_trace, load_trace,
                       lognormal_lengths, lognormal_weights, maf_popularity, poisson_arrivals, rank_mix, save_trace,
                       top_share, zipf_popularity, check_popularity, POPULARITIES)

__all__ = ["Trace", "TraceRequest", "TraceSpec", "gamma_arrivals", "generate_trace", "load_trace",
           "lognormal_lengths", "lognormal_weights", "maf_popularity", "poisson_arrivals", "rank_mix",
           "save_trace", "top_share", "zipf_popularity", "check_popularity", "POPULARITIES"]
