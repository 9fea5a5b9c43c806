"""A mixture-of-experts model's router losses made whole under parallelism: statistics over the global batch
(statistics), router logits carried between pipeline stages (carry), Switch Transformers' own (switch)."""
