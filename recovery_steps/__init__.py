"""Step programs of the recovery workflow (what they share with the trainer is in ``jaxrec``)."""
