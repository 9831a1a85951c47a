"""The model-based chaos test, short version (issue 14): a few seeded sequences of operator
actions and faults against a real deployment, with the invariants of tests/chaos.py checked after
every step and at the end. `make chaos SEED=… STEPS=…` runs long ones (tools/chaos.py).

A failure prints the seed, the steps as they ran and the command that replays them."""
from __future__ import annotations

import os

import pytest
from chaos import ChaosConfig, Sequence, Stats

# Two sequences of 8 steps, about a minute and a half each on 2 cores. Seeds 17 and 21 draw, between
# them, a Redis restart, a SIGKILL and a SIGTERM of a worker, a server and S3 down, pause,
# regenerate and retry-failed (the draws depend only on the seed: tests/chaos.py). CHAOS_SEEDS
# and CHAOS_STEPS change them.
SEEDS = [int(seed) for seed in os.environ.get("CHAOS_SEEDS", "17,21").split(",")]
STEPS = int(os.environ.get("CHAOS_STEPS", "8"))
# Action kinds the short version leaves out while a known production bug makes them fail every
# time (see the report of the chaos test); empty when none.
SHORT_SKIP = frozenset(k for k in os.environ.get("CHAOS_SKIP", "").split(",") if k)


@pytest.mark.timeout(540)  # its own bounds are tighter; this one only stops a hang
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_sequence(tmp_path, seed):
    cfg = ChaosConfig(seed=seed, steps=STEPS, skip=SHORT_SKIP)
    Sequence(tmp_path, cfg, Stats()).run()


# The concurrent version (issue 27): bursts of commands at once on one job, late duplicate
# deliveries, every process's race windows widened. Seed 201's step 2 (a cancel and an enqueue
# at once) found, on the code before the fix, an enqueue that undid the cancel; seed 212's step
# 17 a delete undone by an enqueue. CHAOS_CONCURRENT_SEEDS changes the seeds.
CONCURRENT_SEEDS = [int(seed) for seed in os.environ.get("CHAOS_CONCURRENT_SEEDS", "201").split(",")]


@pytest.mark.timeout(540)
@pytest.mark.parametrize("seed", CONCURRENT_SEEDS)
def test_concurrent_chaos_sequence(tmp_path, seed):
    cfg = ChaosConfig(seed=seed, steps=STEPS, skip=SHORT_SKIP, concurrent=True)
    Sequence(tmp_path, cfg, Stats()).run()
