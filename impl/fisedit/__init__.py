"""FISEdit: cache-enabled sparse diffusion inference for prompt edits (Yu et al., AAAI 2024)."""
