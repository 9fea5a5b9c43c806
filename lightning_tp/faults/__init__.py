"""Surviving a failed rank: errors and heartbeats noted in the store (notes.py), restarts (restarts.py),
SLURM's requeue signal (requeue.py), a training loader that resumes mid-epoch (resumable_data.py)."""
