"""meshtrain: LLM training on one six-axis JAX device mesh."""
