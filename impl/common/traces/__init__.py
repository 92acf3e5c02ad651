"""Request traces for LLM serving: generate -> validate -> save/load, as plain data."""
from .requests import (Trace, TraceRequest, TraceSpec, gamma_arrivals, generate_trace, load_trace,
                       lognormal_lengths, poisson_arrivals, rank_mix, save_trace, zipf_popularity)

__all__ = ["Trace", "TraceRequest", "TraceSpec", "gamma_arrivals", "generate_trace", "load_trace",
           "lognormal_lengths", "poisson_arrivals", "rank_mix", "save_trace", "zipf_popularity"]
