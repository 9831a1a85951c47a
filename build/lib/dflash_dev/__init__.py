"""Development and demonstration tools, never imported by dflash_tasks: the simulated SGLang
server (`sim`), a whole deployment on one machine as processes (`local`), and `make demo`."""
