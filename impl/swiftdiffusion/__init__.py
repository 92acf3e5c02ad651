"""SwiftDiffusion / Katz (arXiv 2407.02031, USENIX ATC'25): diffusion serving with ControlNet and
LoRA add-ons. See README.md."""
