"""Recomputation in backward: whole blocks (full.py), attention cores (selective.py), and the random
streams that make a recomputed block draw the masks it drew first (rng.py)."""
