"""A small tokenizer built by the tests, saved locally, that reproduces the simulated server's
token ids (dflash_dev/sim/tokens.py) under a Qwen3-style chat template.

- model: `tokenizers` WordLevel over whitespace-split pieces: `w<i>` -> i for every ordinary id
  the simulated model can emit; other words the tests use (role names and the like) are
  rewritten by the normalizer to `w<piece_id(word)>`, the id the simulator hashes them to (a
  WordLevel vocabulary cannot hold two pieces with one id);
- special tokens at Qwen3's ids: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645,
  <think> 151667, </think> 151668 (matched in text, so a rendered template tokenizes into them);
- chat template: Qwen3's structure (thinking blocks included): the system turn first, user
  turns, earlier assistant turns with their reasoning dropped, the last assistant turn (after
  the last user query) with `<think>\\n{reasoning}\\n</think>\\n\\n` before its content, and a
  generation prompt that, with enable_thinking false, carries the empty `<think>\\n\\n</think>\\n\\n`.

Whitespace (the template's newlines included) separates pieces and yields no token, exactly as
the simulator's `encode` treats it; so for any row from the simulator, rendering with this
template gives `token_ids.prompt + token_ids.response`.
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash_dev.sim import tokens as sim

QWEN3_STYLE_TEMPLATE = r"""
{%- if messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) -%}
{%- for m in messages[::-1] -%}
  {%- if ns.searching and m.role == 'user' -%}
    {%- set ns.last_query = messages|length - 1 - loop.index0 -%}
    {%- set ns.searching = false -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if m.reasoning_content is not string and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
    {%- else -%}
{{- '<|im_start|>assistant\n' + content -}}
    {%- endif -%}
{{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
""".strip()

EXTRA_WORDS = ("system", "user", "assistant", "tool")


def build_tokenizer(dest: Path, words: tuple[str, ...] = ()) -> Path:
    """Write tokenizer.json and tokenizer_config.json into dest; returns dest."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(sim.VOCAB)}
    vocab["[UNK]"] = sim.VOCAB_SIZE - 1  # an unused id: never produced by the tests' texts
    specials = sorted(sim.SPECIAL_IDS.items(), key=lambda kv: kv[1])
    vocab.update(specials)  # in the model's vocabulary at their ids, then declared special
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([
        normalizers.Replace(Regex(rf"(?<!\S){word}(?!\S)"), f"w{sim.piece_id(word)}")
        for word in dict.fromkeys((*EXTRA_WORDS, *words))])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins pieces with spaces
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)
                            for text, _ in specials])
    for text, want in specials:
        got = tok.token_to_id(text)
        if got != want:
            raise AssertionError(f"{text} got id {got}, Qwen3 has {want}")
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN3_STYLE_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "[UNK]",
        "model_max_length": 40960,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    return dest
