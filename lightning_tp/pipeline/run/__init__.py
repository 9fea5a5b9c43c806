"""Per step: run the schedule's actions inside Lightning's training, eval and epoch-end hooks."""
