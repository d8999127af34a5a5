"""Example tasks for the recovery harness, each a user's model and data outside the trainer."""
