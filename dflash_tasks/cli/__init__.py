"""`manage.py`: a thin command line over the package's modules.

Each command lives in the module named in COMMANDS and is imported only when it runs, so
`status` does not pay for aiohttp (sim-server) and a new command is one module and one line.
"""
from __future__ import annotations

import importlib

import click

COMMANDS = {
    "enqueue": "dflash_tasks.cli.run:enqueue",
    "status": "dflash_tasks.cli.run:status",
    "failed": "dflash_tasks.cli.failures:failed",
    "retry-failed": "dflash_tasks.cli.failures:retry_failed",
    "export": "dflash_tasks.cli.export:export",
    "validate": "dflash_tasks.cli.validate:validate",
    "jobs": "dflash_tasks.cli.jobs:list_jobs",
    "pause": "dflash_tasks.cli.jobs:pause",
    "resume": "dflash_tasks.cli.jobs:resume",
    "cancel": "dflash_tasks.cli.jobs:cancel",
    "delete": "dflash_tasks.cli.jobs:delete",
    "remove-chunks": "dflash_tasks.cli.jobs:remove_chunks_left",
    "set": "dflash_tasks.cli.jobs:set_params",
    "stats": "dflash_tasks.cli.stats:stats",
    "regenerate": "dflash_tasks.cli.regenerate:regenerate",
    "train": "dflash_tasks.cli.train:train",
    "train-cancel": "dflash_tasks.cli.train:train_cancel",
    "train-status": "dflash_tasks.cli.train:train_status",
    "train-eval": "dflash_tasks.cli.train_eval:train_eval",
    "worker": "dflash_tasks.cli.processes:worker",
    "beat": "dflash_tasks.cli.processes:beat",
    "flower": "dflash_tasks.cli.processes:flower",
    "sim-server": "dflash_dev.sim.cli:sim_server",  # a development tool, not in the image
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def resolve_command(self, ctx, args):
        """An unknown command names the nearest ones (`stauts`: did you mean status?)."""
        if args and args[0] not in COMMANDS and not args[0].startswith("-"):
            import difflib

            near = difflib.get_close_matches(args[0], COMMANDS, n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(near)}?" if near else ""
            raise click.UsageError(f"No such command {args[0]!r}.{hint} (`manage.py --help` "
                                   "lists them)", ctx)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name != "dflash_dev":
                raise
            raise click.UsageError(f"`{name}` is a development tool (dflash_dev/, in the "
                                   "repository), not part of this installation") from None


@click.group(cls=LazyGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def cli() -> None:
    """dflash-tasks: generate DFlash drafter training data with SGLang servers and Celery.

    Every command reads its settings from DFLASH_* variables. DFLASH_REDIS_URL points at the
    Redis that holds the jobs (default redis://127.0.0.1:6379/0: whatever Redis runs there);
    DFLASH_OUTPUT_DIR or DFLASH_S3_URI is where a new job's batches go.

    The pieces start in this order: Redis, the SGLang servers, one `worker --gpu I` per GPU
    (workers/launch_node.py starts a node's), `beat` (seals and ships batches), then
    `enqueue`. `make local` starts them all on this machine (README).
    """


def main() -> None:
    from pydantic import ValidationError

    from dflash_tasks.core.settings import describe_invalid
    from dflash_tasks.output.storage import StorageError

    try:
        cli(prog_name="manage.py")
    except ValidationError as exc:
        if exc.title != "Settings":
            raise
        click.echo(f"Error: {describe_invalid(exc)}", err=True)  # nothing has started
        raise SystemExit(2) from None
    except StorageError as exc:
        # The output storage does not answer (S3 cut, a bucket that vanished): a command that
        # reads the shipped batches says so and which object, instead of a traceback.
        click.echo(f"Error: {exc}; the output storage did not answer: try again once it does",
                   err=True)
        raise SystemExit(1) from None
