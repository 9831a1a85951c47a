"""`python -m dflash_tasks.sim --port P ...`: the simulated SGLang server."""
from .cli import sim_server

if __name__ == "__main__":
    sim_server(prog_name="python -m dflash_tasks.sim")
