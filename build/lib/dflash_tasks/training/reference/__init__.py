"""A readable reference trainer for a DFlash drafter (z-lab, "Block Diffusion for Flash
Speculative Decoding"; SpecForge 0.2.0's algorithms/common/dflash_family_model.py trains the same
objective; tests/test_dflash_vs_specforge.py compares the two), reading a
job's rows straight from its shipped batches.

The drafter predicts a whole block of tokens in one forward pass. At inference it is handed the
last accepted token (the anchor) followed by block_size - 1 mask tokens, and, as context, the
frozen target model's hidden states at a few of its layers for every position before the
anchor; the target then verifies the block and keeps its longest correct prefix. Training
reproduces that exact situation on the dataset's sequences: anchors are drawn among the
response tokens, each becomes a block [x[a], MASK, ...], and block position k is labelled with
x[a + k], the very position it will fill at inference (position 0, the anchor, is known and
has no loss).

The context is strictly before the anchor (t < a): at inference the target has not yet run on
the anchor, so its hidden state there does not exist; letting training see it would teach the
drafter to lean on information it never gets. Inside a block attention is bidirectional, and
blocks never see each other, so many blocks of one sequence train in one pass.

An early miss ends acceptance, so position k's cross-entropy is weighted by exp(-(k - 1) / gamma)
(the paper's eq. 4): the first positions, which decide most of the acceptance length, weigh the
most.

Online: the target runs in the training loop to produce its hidden states, instead of reading
them from disk. Stored offline they would take about 90 TB for this project's dataset (five
layers of a 4,096-wide target in bf16 are 40 KB per token), far more than the rows themselves;
the target's forward pass costs less than reading that back.

Modules: `config` (TrainConfig, load_config), `target` (the frozen target and its layers),
`model` (the drafter), `blocks` (anchors, labels, weights, attention mask, loss), `data` (the
job's samples, shuffled), `checkpoints`, `trainer` (train, resume, overfit), `evaluate`
(greedy_acceptance), `speculation` (tau: speculative decoding replayed along a known answer),
`smoke` (the overfit gate), `heldout` (train-eval on held-out prompts).
"""
import importlib

# Imported on first use, so `manage.py train` checks a config (training.config) without
# loading torch and transformers.
_EXPORTS = {"TrainConfig": "config", "load_config": "config", "train": "trainer",
            "TrainResult": "trainer", "load_drafter": "checkpoints",
            "greedy_acceptance": "evaluate"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
