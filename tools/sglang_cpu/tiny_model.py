"""Builds the tiny Qwen2 model the real SGLang server serves in `make test-sglang`.

    .sglang-venv/bin/python tools/sglang_cpu/tiny_model.py OUT_DIR

A Qwen2 of hidden size 64 and 2 layers with a byte-level BPE tokenizer of about 1,000 tokens
(trained here with `tokenizers`) and a Qwen3-style chat template with thinking blocks;
`max_position_embeddings` is 40,960 so an 8,192-token request is accepted.

Its weights are random except where a test needs to know the answer: attention and MLP outputs
are zero, so the residual stream is the current token's embedding and the model is a bigram
table. Every token leads into one fixed script, `SCRIPT`: a few words of reasoning, `</think>`,
a few words of answer, then `<|im_end|>` (the EOS). So whatever the prompt and sampling
parameters, a generation says REASONING, then ANSWER, and stops after SCRIPT_TOKENS tokens;
a smaller cap stops it with finish_reason "length", and continuing a cut generation from its
token ids (/generate) ends exactly as one longer generation would.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REASONING = "Let me think about this problem carefully"
ANSWER = "The answer is forty two"
QWEN3_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
             151667: "<think>", 151668: "</think>"}
ADDED = {"<think>", "</think>"}  # added but not special, as in Qwen3: they stay in /generate's text
FIRST_SPECIAL_ID, THINK_END_ID = 151643, 151668
BPE_SIZE = 1000
VOCAB_SIZE = 151936  # Qwen3's embedding rows
HIDDEN = 64
SEED = 20261202

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def corpus() -> list[str]:
    words = ("the quick brown fox jumps over a lazy dog while reasoning about numbers and words "
             "task case prompt answer question explain think step careful hello world").split()
    lines = [REASONING, ANSWER, " ".join(words)]
    lines += [f"Task {i}: reason about case {i * 104729 % 9973}." for i in range(200)]
    lines += [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(len(words))]
    return lines * 20


def build_tokenizer():
    """A byte-level BPE of about 1,000 tokens whose special tokens sit at Qwen3's ids
    (<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, <think> 151667,
    </think> 151668), so code that knows Qwen3's ids works on the tiny model as on the real one;
    the ids between are unreachable fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import ByteLevel as ByteLevelProcessor

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(corpus(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<|unused_{i}|>"] = i
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = ByteLevelProcessor(trim_offsets=False)
    for i in range(FIRST_SPECIAL_ID, THINK_END_ID + 1):
        name = QWEN3_IDS.get(i, f"<|reserved_{i}|>")
        special = name not in ADDED
        tok.add_tokens([AddedToken(name, special=special, normalized=False)])
        assert tok.token_to_id(name) == i, (name, i, tok.token_to_id(name))
    return tok


def script_ids(tok) -> list[int]:
    think_end = tok.token_to_id("</think>")
    eos = tok.token_to_id("<|im_end|>")
    ids = ([tok.token_to_id("<think>")] + tok.encode(REASONING).ids + [think_end]
           + tok.encode(ANSWER).ids + [eos])
    assert len(set(ids)) == len(ids), "the script repeats a token: a bigram table would loop"
    return ids


def build(out: Path) -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = script_ids(tok)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=eos, torch_dtype="float32", use_sliding_window=False)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # no attention, no MLP: the output is a bigram table
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        # Every token's embedding points along one of HIDDEN orthogonal axes: the script's
        # tokens each get an axis of their own, every other token shares the "start" axis.
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        emb.zero_()
        head.zero_()
        start_axis = 0
        emb[:, start_axis] = 1.0
        for position, token in enumerate(ids):
            emb[token].zero_()
            emb[token, position + 1] = 1.0
        # After the final RMSNorm an axis reads sqrt(HIDDEN) = 8; a logit of 8 * 5 = 40 over
        # zeros leaves every other token a probability below e^-33 at temperature 1.
        head[ids[0], start_axis] = 5.0
        for position, token in enumerate(ids[:-1]):
            head[ids[position + 1], position + 1] = 5.0
        head[ids[0], len(ids)] = 5.0  # after the EOS (never sampled past), back to the start
    assert len(ids) + 1 < HIDDEN
    model.save_pretrained(out, safe_serialization=True)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 40960
    fast.save_pretrained(out)
    generation = {"eos_token_id": [eos], "pad_token_id": tok.token_to_id("<|endoftext|>")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    facts = {"script_ids": ids, "script_tokens": len(ids), "reasoning": REASONING,
             "answer": ANSWER, "reasoning_tokens": ids.index(tok.token_to_id("</think>")) + 1,
             "eos_id": eos, "think_end_id": tok.token_to_id("</think>")}
    (out / "script.json").write_text(json.dumps(facts, indent=2))
    return facts


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1]))))
