"""Builds the tiny Qwen2 model the real SGLang server serves in `make test-sglang`.

    .sglang-venv/bin/python tools/sglang_cpu/tiny_model.py OUT_DIR [--variant penalty]

A Qwen2 of hidden size 64 and 2 layers with a byte-level BPE tokenizer (trained here with
`tokenizers`, Qwen2's pre-tokenizer regex, special tokens at Qwen3's ids) and a Qwen3-style chat
template with thinking blocks; `max_position_embeddings` is 40,960 so an 8,192-token request is
accepted.

Its weights are random except where a test needs to know the answer: attention and MLP outputs
are zero, so the residual stream is the current token's embedding and the model is a bigram
table. Every token leads into one fixed script of token ids, as Qwen3 writes a thinking answer:

    <think>\\nOkay, 中文 is fun.\\n</think>\\n\\nThe answer: 好😀 yes<|im_end|>

Its characters are chosen so that a cut can fall inside one: 中 is two tokens (a space with its
first byte, then the other two), 文 three single bytes, 好 two (a space with two bytes, then one)
and 😀 three (two bytes, one, one); the newline before `</think>` is inside the token `.\\n`, and
`\\n\\n` after it is one token, as in Qwen's vocabulary; the newline after `<think>` is one
token with "Okay" (FIRST_TOKEN: the prompt ends with the token "\\n"). A bigram table cannot
say a token twice without looping, so no token repeats (script_ids asserts it), which is why the
bytes of the characters are all different and the merges below are chosen by hand.

So whatever the prompt and sampling parameters, a generation says that script and stops after
its last token (the EOS); a smaller cap stops it with finish_reason "length", and continuing a
cut generation from its token ids (/generate) goes on exactly as one longer generation would.
script.json records the script, its text and what the chat endpoint answers for it.

`--variant penalty` builds the same model with a generation_config.json that sets
`repetition_penalty` 1.05 and `min_p` 0.5, and one trap: after 😀 the token " fun" (said earlier,
in the reasoning) scores 41 against the script's " yes" at 40. Penalised (41 / 1.05 = 39.05) it
loses, and the script goes on; unpenalised it wins and the output loops (` fun.\\n</think>...`)
until the cap. min_p 0.5 makes either choice certain at any temperature (the loser's probability
is e^-0.95 or e^-1 of the winner's, under 0.5), so the two outcomes are deterministic. The chat
endpoint applies generation_config's values (SGLang's `--sampling-defaults model`), /generate
never does: they sample alike only when the client sends the same parameters to both. And since
SGLang's penalties count only a request's own output ids, a /generate continuation cut after
" fun" and before the trap does not penalise it and leaves the script.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

THINK_START_TEXT = "<think>"
REASONING = "\nOkay, 中文 is fun.\n"
ANSWER = "\n\nThe answer: 好😀 yes"
QWEN3_IDS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
             151667: "<think>", 151668: "</think>"}
ADDED = {"<think>", "</think>"}  # added but not special, as in Qwen3: they stay in /generate's text
FIRST_SPECIAL_ID, THINK_END_ID = 151643, 151668
BPE_SIZE = 1000
VOCAB_SIZE = 151936  # Qwen3's embedding rows
HIDDEN = 64
SEED = 20261202
# Qwen2/Qwen3's pre-tokenizer: punctuation keeps the newlines after it (".\n"), newlines group.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Merges added after the trained ones, in byte-level symbols (Ġ space, Ċ newline; ä¸Ń is 中,
# æĸĩ 文, å¥½ 好, ðŁĺĢ 😀): each character splits where a cut should be able to fall.
EXTRA_MERGES = [("Ċ", "Ċ"), (".", "Ċ"), ("Ġ", "ä"), ("¸", "Ń"), ("Ġ", "å"), ("Ġå", "¥"),
                ("ð", "Ł")]
# The newline after <think> cannot be the token "\n" (Ċ): the prompt ends with it
# ("<|im_start|>assistant\n"), and a bigram table would go on from there as from the script. So
# the script says "\nOkay" as one token that no merge makes (any model may say a token its
# tokenizer would not choose; the text is the same).
FIRST_TOKEN, FIRST_TOKEN_TEXT = "ĊOkay", "\nOkay"
VARIANTS = ("plain", "penalty")
PENALTY = {"repetition_penalty": 1.05, "min_p": 0.5}
TRAP_TOKEN_TEXT, TRAP_BEFORE_TEXT = " fun", " yes"  # the trap: " fun" tempts where " yes" is due
LOGIT = 5.0        # head weight on an axis: after RMSNorm an axis reads sqrt(HIDDEN) = 8 -> 40
TRAP_LOGIT = 41.0 / 8  # 41: beats 40, loses to it once divided by 1.05

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
             "task case prompt answer question explain think step careful hello world okay "
             "is fun yes").split()
    lines = ["Okay, this is fun.", "The answer: yes", " ".join(words)]
    lines += [f"Task {i}: reason about case {i * 104729 % 9973}." for i in range(200)]
    lines += [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(len(words))]
    return lines * 20


def pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def build_tokenizer():
    """A byte-level BPE whose special tokens sit at Qwen3's ids (<|endoftext|> 151643,
    <|im_start|> 151644, <|im_end|> 151645, <think> 151667, </think> 151668), so code that knows
    Qwen3's ids works on the tiny model as on the real one; the ids between are unreachable
    fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import ByteLevel as ByteLevelProcessor

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(corpus(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    for left, right in EXTRA_MERGES:
        assert (left, right) not in merges and left in vocab and right in vocab, (left, right)
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    vocab[FIRST_TOKEN] = len(vocab)  # no merge makes it: only the model says it
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizer()
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
    head = tok.token_to_id(FIRST_TOKEN)
    reasoning = REASONING[len(FIRST_TOKEN_TEXT):]
    ids = ([tok.token_to_id("<think>"), head] + tok.encode(reasoning).ids + [think_end]
           + tok.encode(ANSWER).ids + [eos])
    assert len(set(ids)) == len(ids), "the script repeats a token: a bigram table would loop"
    return ids


def split_characters(tok, ids: list[int]) -> list[int]:
    """The cuts (numbers of script tokens) that fall inside a character: each decodes to a text
    ending in U+FFFD. Asserts every multi-byte character of the script spans several tokens."""
    inside = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    for char in "中文好😀":
        assert any(tok.decode(ids[:k]).endswith("\ufffd") and char in tok.decode(ids[:k + 1])
                   for k in inside) or char not in REASONING + ANSWER, char
    return inside


def facts_of(tok, ids: list[int], variant: str) -> dict:
    eos = tok.token_to_id("<|im_end|>")
    think_end = ids.index(tok.token_to_id("</think>"))
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == THINK_START_TEXT + REASONING + "</think>" + ANSWER, text
    facts = {
        "variant": variant, "script_ids": ids, "script_tokens": len(ids),
        "text": text,                       # all ids decoded at once, special tokens skipped
        "think_end_index": think_end,       # ids[think_end_index] is </think>
        "reasoning_tokens": think_end + 1,  # SGLang counts up to and including </think>
        # What the chat endpoint answers for the whole script (thinking on, separate_reasoning):
        # the qwen3 parser strips the leading <think> and splits at </think>, nothing more.
        "reasoning_content": REASONING, "content": ANSWER,
        "reasoning": REASONING.strip(), "answer": ANSWER.strip(),
        "eos_id": eos, "think_end_id": tok.token_to_id("</think>"),
        "cuts_inside_a_character": split_characters(tok, ids),
        "tokens": [tok.id_to_token(i) for i in ids],
    }
    if variant == "penalty":
        trap = ids.index(tok.encode(TRAP_TOKEN_TEXT).ids[0])
        due = ids.index(tok.encode(TRAP_BEFORE_TEXT).ids[0])
        facts["penalty"] = {**PENALTY, "trap_token": ids[trap], "trap_token_index": trap,
                            "trap_index": due}
    return facts


def build(out: Path, variant: str = "plain") -> dict:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    assert variant in VARIANTS, variant
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = script_ids(tok)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    facts = facts_of(tok, ids, variant)

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
        head[ids[0], start_axis] = LOGIT
        for position, token in enumerate(ids[:-1]):
            head[ids[position + 1], position + 1] = LOGIT
        head[ids[0], len(ids)] = LOGIT  # after the EOS (never sampled past), back to the start
        if variant == "penalty":  # where the script is due, the trap token scores 41
            trap = facts["penalty"]
            head[trap["trap_token"], trap["trap_index"]] = TRAP_LOGIT
    assert len(ids) + 1 < HIDDEN
    model.save_pretrained(out, safe_serialization=True)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 40960
    fast.save_pretrained(out)
    generation = {"eos_token_id": [eos], "pad_token_id": tok.token_to_id("<|endoftext|>")}
    if variant == "penalty":
        generation.update(PENALTY)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "script.json").write_text(json.dumps(facts, indent=2, ensure_ascii=False))
    return facts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", choices=VARIANTS, default="plain")
    args = parser.parse_args()
    print(json.dumps(build(args.out, args.variant), ensure_ascii=False))
