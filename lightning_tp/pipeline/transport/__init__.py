"""Point-to-point transfers between stages: eager and time-slotted, one message per microbatch."""
