"""`python -m dflash_dev.sim --port P ...`: the simulated SGLang server."""
from dflash_dev.sim.cli import sim_server

if __name__ == "__main__":
    sim_server(prog_name="python -m dflash_dev.sim")
