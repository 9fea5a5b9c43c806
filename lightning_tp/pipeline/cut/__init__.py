"""Set-up time: find a model's block lists and cut it into stages, with placeholders for the rest."""
