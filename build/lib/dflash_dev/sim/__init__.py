"""The simulated SGLang server: the one stand-in the tests, the demo and the benchmarks run against.

`tokens` is its pseudo-tokenizer (Qwen3's chat template, fixed special ids), `lengths` the
deterministic output-length model (also usable without a server, e.g. for an ideal makespan),
`server` the aiohttp application and `cli` the `sim-server` command
(`python -m dflash_dev.sim --port P`).
"""
