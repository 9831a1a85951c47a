"""The Celery application. Configuration lives in the repository's top-level celeryconfig.py."""
from celery import Celery

app = Celery("dflash_tasks")
app.config_from_object("celeryconfig")

from dflash_tasks.worker import hooks  # noqa: E402  (the app must exist first)

hooks.connect(app)
