"""A tiny randomly initialised Qwen3 saved as a local model directory, with the tests' tokenizer
beside it: a real transformers target for the reference trainer, built in a second. Its
vocabulary has Qwen3's full 151,936 rows because rows carry Qwen3's special ids (151643..151668)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_support import build_tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a test module's training: steadier than 2 on a loaded 2-core
    machine. A module uses it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`
    after importing it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tiny_target(dest: Path, layers: int = 4, seed: int = 0) -> Path:
    """Save the model (float32) and the tokenizer into dest; returns dest."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False,
        # Weights at std 0.2 rather than transformers' 0.02: a trained LM head turns a unit-RMS
        # hidden state into logits of a few units, a 0.02 one into ~0.16, and a drafter behind
        # that frozen head would spend its first thousand steps growing its final norm instead
        # of learning (the loss barely moves from ln(151936) in the few hundred steps tests run).
        initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32)
    dest = Path(dest)
    model.save_pretrained(dest)
    build_tokenizer(dest)
    return dest
