"""`python -m dflash_tasks.cli`: manage.py's commands from the installed package (the node
launcher starts its workers so, wherever it runs)."""
from dflash_tasks.cli import main

main()
