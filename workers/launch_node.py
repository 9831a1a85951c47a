#!/usr/bin/env python3
"""What runs on a GPU node: one SGLang server per GPU, one Celery worker per server, supervised.
The launcher itself is dflash_tasks/cli/launch_node.py (its docstring says what it does, in
order); this file runs it from a checkout, as the `launch_node.py` command does from anywhere."""
from dflash_tasks.cli.launch_node import run

if __name__ == "__main__":
    run()
