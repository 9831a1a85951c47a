"""The Celery application. Configuration lives in the repository's top-level celeryconfig.py:
its names, and what `deployment` derives from this process's Settings."""
import importlib
import logging

from celery import Celery, signals

from dflash_tasks.core.settings import get_settings

app = Celery("dflash_tasks")
app.config_from_object("celeryconfig")
# Read when the configuration is first needed, not when this module is imported (celeryconfig
# itself imports the package, which makes this app).
app.add_defaults(lambda: importlib.import_module("celeryconfig").deployment(get_settings()))

from dflash_tasks.worker import hooks, transport  # noqa: E402  (the app must exist first)

# kombu's Redis transport, except that a queue entry that is not a kombu message is logged and
# dropped, and a lost Redis connection is reconnected, instead of either ending the worker.
# Registered as the transport of redis:// (and rediss://) URLs, its Sentinel variant as that of
# sentinel:// ones, rather than named in broker_transport: the broker URL keeps its scheme for
# the tools that read it (Flower's queue lengths), and kombu, which re-reads the transport from
# the URL's scheme when it reconnects, keeps using it after a Redis restart or a failover.
transport.register()
hooks.connect(app)


def _check_storage(sender, instance, **_):
    """With DFLASH_S3_URI set, a worker refuses to start without credentials, and beat (the
    shipper, on the control queue) with a bucket that refuses them or does not exist too: such
    a process would fail every read or upload, quietly, for as long as it runs. (Here, not in
    worker/hooks.py: the storage is a stage above the worker.)"""
    from dflash_tasks.core.keys import CONTROL_QUEUE
    from dflash_tasks.output.storage import storage_for
    from dflash_tasks.worker.runtime import runtime

    s = runtime().settings
    if not s.s3_uri:
        return
    ships = CONTROL_QUEUE in (instance.app.amqp.queues.consume_from or {})
    problem = storage_for(s).check(bucket=ships)
    if problem:
        logging.getLogger(__name__).critical("%s", problem)
        raise SystemExit(2)


signals.celeryd_after_setup.connect(_check_storage, weak=False,
                                    dispatch_uid="dflash_tasks._check_storage")
