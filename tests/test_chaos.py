"""The model-based chaos test, short version (issue 14): a few seeded sequences of operator
actions and faults against a real deployment, with the invariants of tests/chaos.py checked after
every step and at the end. `make chaos SEED=… STEPS=…` runs long ones (tools/chaos.py).

A failure prints the seed, the steps as they ran and the command that replays them."""
from __future__ import annotations

import os

import pytest

from chaos import ChaosConfig, Sequence, Stats

# Two sequences of 8 steps: about a minute each on 2 cores. CHAOS_SEED moves them.
BASE_SEED = int(os.environ.get("CHAOS_SEED", "1"))
STEPS = int(os.environ.get("CHAOS_STEPS", "8"))
# Action kinds the short version leaves out while a known production bug makes them fail every
# time (see the report of the chaos test); empty when none.
SHORT_SKIP = frozenset(k for k in os.environ.get("CHAOS_SKIP", "").split(",") if k)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [BASE_SEED, BASE_SEED + 1])
def test_chaos_sequence(tmp_path, seed):
    cfg = ChaosConfig(seed=seed, steps=STEPS, skip=SHORT_SKIP)
    Sequence(tmp_path, cfg, Stats()).run()
