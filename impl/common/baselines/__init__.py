"""Baselines two papers both run, once: the Megatron-like grid rule (:mod:`.megatron_grid`), the
static single-layout grid search of the Megatron-like / DeepSpeed-like baselines (:mod:`.static`)
and HotSPa-like bucketed hot switching (:mod:`.hotspa_like`). Each takes a small typed config that
validates itself; where two papers ran a baseline differently, the difference is a knob of that
config and each paper passes its own setting. Pricing a layout stays the paper's (its cost model),
handed in as a function.
"""
