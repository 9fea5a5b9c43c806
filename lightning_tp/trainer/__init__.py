"""What runs in Lightning's loop besides the model: one batch per model copy (same_batch.py), averaged
models of the sharded module (averaged_models.py), the pipeline timeline callback (timeline.py)."""
