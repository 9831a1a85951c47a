"""Celery tasks: `generate` (one prompt, on its GPU's queue) and the beat tasks on `control`."""
