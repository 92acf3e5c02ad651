"""LobRA: multi-tenant LoRA fine-tuning on heterogeneous replicas (spec lobra)."""
