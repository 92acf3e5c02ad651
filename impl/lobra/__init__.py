"""LobRA: multi-tenant LoRA fine-tuning on heterogeneous replicas (LobRA, arXiv 2509.01193; impl/lobra/README.md)."""
