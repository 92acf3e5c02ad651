"""Multi-LoRA LLM serving substrate: ragged HF Llama forward, LoRA kernels, adapter pool, batch
scheduler and the real-mode engine, shared by CaraServe and the serving baselines it is compared with."""
