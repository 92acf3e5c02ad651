"""Request-level discrete-event simulation of multi-LoRA serving (one or many servers)."""
from .cost import ServingCost
from .cluster import ServingSimResult, simulate

__all__ = ["ServingCost", "ServingSimResult", "simulate"]
