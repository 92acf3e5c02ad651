"""CaraServe (Toppings): CPU-assisted, rank-aware multi-LoRA serving, and its baselines."""
