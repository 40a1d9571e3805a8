"""Synthetic generations: the prompt pool, the chat client, resumable batches."""
