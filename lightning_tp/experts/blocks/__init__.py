"""What runs in place of a model's mixture-of-experts layers each step: ``ModuleList`` families' block (layer),
transformers 5.x experts modules (fused), Switch Transformers' and Llama 4's blocks, grouped GEMMs."""
