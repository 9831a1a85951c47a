#!/usr/bin/env python3
"""dflash-tasks command line: `python manage.py --help`."""
from dflash_tasks.cli import main

if __name__ == "__main__":
    main()
