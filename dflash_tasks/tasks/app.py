"""The Celery application. Configuration lives in the repository's top-level celeryconfig.py."""
from celery import Celery

app = Celery("dflash_tasks")
app.config_from_object("celeryconfig")

from dflash_tasks.worker import hooks, transport  # noqa: E402  (the app must exist first)

# kombu's Redis transport, except that a queue entry that is not a kombu message is logged and
# dropped, and a lost Redis connection is reconnected, instead of either ending the worker.
# Registered as the transport of redis:// (and rediss://) URLs, its Sentinel variant as that of
# sentinel:// ones, rather than named in broker_transport: the broker URL keeps its scheme for
# the tools that read it (Flower's queue lengths), and kombu, which re-reads the transport from
# the URL's scheme when it reconnects, keeps using it after a Redis restart or a failover.
transport.register()
hooks.connect(app)
