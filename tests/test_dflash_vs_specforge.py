"""The reference DFlash trainer (dflash_tasks.training.reference) against SpecForge 0.2.0's DFlash,
on CPU with tiny random tensors. SpecForge's own functions are called, never re-derived:

- the block attention mask: `create_dflash_sdpa_mask` and the flex mask's `mask_mod`
  (specforge/algorithms/common/dflash_family_model.py);
- the anchors: `OnlineDFlashModel._sample_anchor_positions`, seeded like the reference;
- the position-decayed loss: `OnlineDFlashModel._dflash_objective_chunk_terms`;
- the context: `build_target_layer_ids` and `extract_context_feature`
  (specforge/modeling/draft/dflash.py);
- all of it at once: `OnlineDFlashModel.forward` over SpecForge's `DFlashDraftModel` holding the
  reference drafter's weights gives the reference's loss, accuracy and gradients.

Where the two differ by design, a test says so and checks the difference (docs/TRAINING.md, "The
reference trainer checked against SpecForge"). SpecForge imports on CPU as installed (no shim)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers

from dflash_tasks.training.reference.blocks import (
    IGNORE,
    block_attention_mask,
    block_loss,
    build_blocks,
    sample_anchors,
)
from dflash_tasks.training.reference.config import TrainConfig
from dflash_tasks.training.reference.model import Drafter, DrafterSpec, block_hidden, logits
from dflash_tasks.training.reference.target import default_layer_ids, mask_token_id, target_hidden

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # specforge's EAGLE drafter warns that flash_attn is absent
    from specforge.algorithms.common.dflash_family_model import (
        OnlineDFlashModel,
        create_dflash_block_mask,
        create_dflash_sdpa_mask,
    )
    from specforge.modeling.draft.dflash import (
        DFlashDraftModel,
        build_target_layer_ids,
        extract_context_feature,
    )
    from specforge.training.model_utils import resolve_mask_token_id

VOCAB, HIDDEN, TARGET_LAYERS, DRAFT_LAYERS, BLOCK = 64, 32, 6, 2, 4
MASK_ID = VOCAB - 1


@pytest.fixture(scope="module")
def target() -> transformers.Qwen3ForCausalLM:
    """A tiny random Qwen3 target, frozen."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def reference_drafter(target) -> Drafter:
    spec = DrafterSpec.from_target(
        target.config, num_layers=DRAFT_LAYERS,
        target_layer_ids=default_layer_ids(TARGET_LAYERS, DRAFT_LAYERS), block_size=BLOCK,
        mask_token_id=MASK_ID, target_model="tiny")
    torch.manual_seed(1)
    return Drafter(spec)


def specforge_model(target, drafter: Drafter, *, backend: str, num_anchors: int,
                    gamma: float | None) -> OnlineDFlashModel:
    """SpecForge's training model around its DFlashDraftModel, built as its
    algorithms/model_providers.py builds it, holding the reference drafter's weights."""
    config = transformers.Qwen3Config(**{**target.config.to_dict(),
                                         "num_hidden_layers": DRAFT_LAYERS,
                                         "layer_types": ["full_attention"] * DRAFT_LAYERS})
    config.num_target_layers = TARGET_LAYERS
    config.block_size = BLOCK
    config.dflash_config = {"target_layer_ids": list(drafter.spec.target_layer_ids),
                            "mask_token_id": MASK_ID}
    config._attn_implementation = backend
    draft = DFlashDraftModel(config)
    # The same module names: a reference checkpoint loads into SpecForge's drafter as it is.
    draft.load_state_dict(drafter.state_dict(), strict=True)
    return OnlineDFlashModel(draft, target.lm_head, target.model.embed_tokens, MASK_ID,
                             block_size=BLOCK, attention_backend=backend,
                             num_anchors=num_anchors, loss_decay_gamma=gamma,
                             objective_chunk_blocks=0)


def random_rows(seed: int, batch: int = 3, seq: int = 24) -> dict[str, torch.Tensor]:
    """Right-padded rows as pad_collate makes them: a prompt (loss 0), a response (loss 1) with
    a gap in one row (a multi-turn mask), padding (attention 0, loss 0)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq, dtype=torch.long)
    attention = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        length = seq - 5 * row
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        loss_mask[row, prompt:length] = 1
        attention[row, length:] = 0
        input_ids[row, length:] = 0
    loss_mask[0, 12:15] = 0  # an unsupervised turn inside the response
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention}


# -- the block attention mask ---------------------------------------------------------------------


def flex_mask(anchors, keep, seq: int) -> torch.Tensor:
    """SpecForge's flex-attention mask (its default backend) made dense by calling its mask_mod
    on every (query, key) pair."""
    block_mask = create_dflash_block_mask(anchors, keep, seq, BLOCK, torch.device("cpu"))
    q = torch.arange(anchors.shape[1] * BLOCK).view(1, -1, 1)
    kv = torch.arange(seq + anchors.shape[1] * BLOCK).view(1, 1, -1)
    b = torch.arange(anchors.shape[0]).view(-1, 1, 1)
    return block_mask.mask_mod(b, torch.zeros((), dtype=torch.long), q, kv)


@pytest.mark.parametrize("seed", range(4))
def test_block_mask_matches_specforge(seed):
    rows = random_rows(seed)
    seq = rows["input_ids"].shape[1]
    anchors, keep = sample_anchors(rows["loss_mask"], 12, torch.Generator().manual_seed(seed))
    assert not keep.all()  # the short rows have blocks without an anchor: both cases are seen
    ours = block_attention_mask(anchors, keep, rows["attention_mask"], BLOCK)
    sdpa = create_dflash_sdpa_mask(anchors, keep, seq, BLOCK, torch.device("cpu"))[:, 0]
    assert torch.equal(flex_mask(anchors, keep, seq), sdpa)

    kept = keep.repeat_interleave(BLOCK, dim=1)  # [batch, queries]
    assert torch.equal(ours[kept], sdpa[kept])
    # By design: a block without an anchor sees its own block, not nothing, so that no query
    # row is all False (SDPA's answer to such a row has been NaN in torch releases). SpecForge
    # hides everything from it. Neither carries a loss, and no other block sees it.
    q = torch.arange(ours.shape[1])
    own = torch.cat([torch.zeros(len(q), seq, dtype=torch.bool),
                     q[:, None] // BLOCK == q[None, :] // BLOCK], dim=1)
    for row, query in (~kept).nonzero().tolist():
        assert not sdpa[row, query].any()
        assert torch.equal(ours[row, query], own[query])


def test_padding_never_enters_a_context():
    """The reference also hides padding (attention_mask 0) from the context; SpecForge has no
    attention mask at all. With right padding (pad_collate's) an anchor always comes before the
    padding, so the two agree; with left padding only the reference would hide it."""
    rows = random_rows(9)
    anchors, keep = sample_anchors(rows["loss_mask"], 64, torch.Generator().manual_seed(9))
    with_padding = block_attention_mask(anchors, keep, rows["attention_mask"], BLOCK)
    without = block_attention_mask(anchors, keep, torch.ones_like(rows["attention_mask"]), BLOCK)
    assert torch.equal(with_padding, without)


# -- anchors --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def online(target) -> OnlineDFlashModel:
    return specforge_model(target, reference_drafter(target), backend="sdpa", num_anchors=8,
                           gamma=7.0)


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_anchors_match_specforge_given_the_same_random_state(online, n):
    online.num_anchors = n
    for seed in range(12):
        rows = random_rows(seed)
        torch.manual_seed(seed)  # SpecForge draws from the global generator
        theirs = online._sample_anchor_positions(rows["input_ids"].shape[1], rows["loss_mask"],
                                                 torch.device("cpu"))
        ours = sample_anchors(rows["loss_mask"], n, torch.Generator().manual_seed(seed))
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), (n, seed)
    # the blocks are as many as the row with the most candidates needs, up to n
    assert ours[0].shape[1] == min(n, int((rows["loss_mask"][:, 1:-1] *
                                           rows["loss_mask"][:, 2:]).sum(1).max()))


def test_anchor_differences_by_design(online):
    # Position 0 has no context before it (at inference the first anchor comes after the
    # prompt), so the reference never draws it; SpecForge does when loss_mask[0] and [1] are 1
    # (chat rows never have that: position 0 is the prompt's).
    online.num_anchors = 16
    loss_mask = torch.ones(1, 16, dtype=torch.long)
    torch.manual_seed(0)
    theirs, _ = online._sample_anchor_positions(16, loss_mask, torch.device("cpu"))
    ours, keep = sample_anchors(loss_mask, 16, torch.Generator().manual_seed(0))
    assert theirs[0].tolist() == list(range(15))
    assert ours[0][keep[0]].tolist() == list(range(1, 15))
    # A batch without two consecutive supervised tokens: SpecForge raises, the reference gives
    # one block per row without an anchor (no loss), so a step on it changes nothing.
    single = torch.tensor([[0, 0, 1, 0, 1, 0]])
    with pytest.raises(ValueError, match="two consecutive supervised tokens"):
        online._sample_anchor_positions(6, single, torch.device("cpu"))
    assert [t.tolist() for t in sample_anchors(single, 4, torch.Generator())] == [[[0]], [[False]]]


# -- the position-decayed loss --------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [7.0, 2.5, None, 0.0])
def test_decayed_loss_matches_specforge(online, gamma):
    decay = TrainConfig(target_model="x", decay_gamma=gamma).decay()
    online.loss_decay_gamma = gamma
    rows = random_rows(3)
    anchors, keep = sample_anchors(rows["loss_mask"], 8, torch.Generator().manual_seed(3))
    blocks = build_blocks(rows["input_ids"], rows["loss_mask"], rows["attention_mask"], anchors,
                          keep, block_size=BLOCK, mask_token_id=MASK_ID, gamma=decay)
    batch, n = anchors.shape
    hidden = torch.randn(batch, n, BLOCK, HIDDEN, generator=torch.Generator().manual_seed(4))
    labelled = blocks.labels != IGNORE
    # SpecForge's targets where there is no label are real tokens of weight 0; any token will do
    target_ids = blocks.labels.clamp(min=0).view(batch, n, BLOCK)
    num, den, correct, counted = online._dflash_objective_chunk_terms(
        hidden, target_ids, labelled.float().view(batch, n, BLOCK))

    flat = hidden.view(batch, n * BLOCK, HIDDEN)[labelled]
    k = (torch.arange(n * BLOCK) % BLOCK).expand_as(labelled)[labelled]
    loss, ours_correct, ours_total = block_loss(online.lm_head(flat), blocks.labels[labelled],
                                                blocks.weights[labelled], k, BLOCK)
    assert loss.item() == pytest.approx((num / den).item(), rel=1e-6)
    assert int(ours_correct.sum()) == int(correct) and int(ours_total.sum()) == int(counted)
    if decay is not None:  # w_k = exp(-(k - 1) / gamma), the anchor's 0
        assert blocks.weights[labelled].tolist() == pytest.approx(
            [math.exp(-(int(p) - 1) / decay) for p in k])


# -- the context: which target layers, how they are combined --------------------------------------


def test_default_target_layers_match_specforge():
    for layers in range(4, 100):
        for n in range(1, 9):
            assert default_layer_ids(layers, n) == build_target_layer_ids(layers, n), (layers, n)
    # Below 4 target layers SpecForge's spread (1 to layers - 3) leaves the model (a negative
    # index); the reference clamps it into 0..layers - 1.
    assert build_target_layer_ids(2, 2) == [1, -1] and default_layer_ids(2, 2) == [1, 0]


def test_context_is_specforges_target_layers_concatenated(target):
    """The context is the output of each target layer k, concatenated in the order of the ids.
    SpecForge's HF path (`extract_context_feature`, used by `DFlashDraftModel.spec_generate`)
    reads it as HF's hidden_states[k + 1]. Its training runs take it from an SGLang capture
    server, which cannot run here: specforge/offline_capture/sglang_backend/capture.py lines
    89-113 hand the ids to the model's `set_dflash_layers_to_capture`, which in SGLang captures
    the residual stream entering layer k + 1 (SGLang's hooks add 1 to each id). That is checked
    here with a hook on the input of layer k + 1 (so SGLang cannot capture the last layer)."""
    rows = random_rows(5)
    layers = [1, 3, 4]
    ours = target_hidden(target, rows["input_ids"], rows["attention_mask"], layers)
    entering: dict[int, torch.Tensor] = {}

    def capture(k):
        def hook(module, args, kwargs):
            entering[k] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    hooks = [target.model.layers[k + 1].register_forward_pre_hook(capture(k), with_kwargs=True)
             for k in layers]
    try:
        with torch.no_grad():
            out = target(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                         output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    theirs = extract_context_feature(out.hidden_states, layers)
    assert ours.shape == (*rows["input_ids"].shape, len(layers) * HIDDEN)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(ours, torch.cat([entering[k] for k in layers], dim=-1), atol=1e-6)


# -- everything at once: SpecForge's forward holding the reference drafter's weights --------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_loss_accuracy_and_gradients_match_specforge(target, backend):
    drafter = reference_drafter(target)
    online = specforge_model(target, drafter, backend=backend, num_anchors=12, gamma=7.0)
    rows = random_rows(7)
    hidden = target_hidden(target, rows["input_ids"], rows["attention_mask"],
                           list(drafter.spec.target_layer_ids))

    torch.manual_seed(11)
    their_loss, their_accuracy, _ = online(rows["input_ids"], hidden, rows["loss_mask"])
    torch.manual_seed(11)
    anchors, keep, their_out = online._forward_draft_blocks(rows["input_ids"], hidden,
                                                            rows["loss_mask"])
    their_loss.backward()

    ours_anchors, ours_keep = sample_anchors(rows["loss_mask"], 12,
                                             torch.Generator().manual_seed(11))
    assert torch.equal(ours_anchors, anchors) and torch.equal(ours_keep, keep)
    assert not keep.all()  # blocks without an anchor are present, and change nothing
    blocks = build_blocks(rows["input_ids"], rows["loss_mask"], rows["attention_mask"], anchors,
                          keep, block_size=BLOCK, mask_token_id=MASK_ID, gamma=7.0)
    out = block_hidden(target, drafter, hidden, blocks.input_ids, blocks.positions, blocks.mask)
    kept = keep.repeat_interleave(BLOCK, dim=1)
    assert torch.allclose(out[kept], their_out.detach()[kept], atol=1e-5)

    labelled = blocks.labels != IGNORE
    k = (torch.arange(labelled.shape[1]) % BLOCK).expand_as(labelled)[labelled]
    loss, correct, total = block_loss(logits(target, out[labelled]), blocks.labels[labelled],
                                      blocks.weights[labelled], k, BLOCK)
    loss.backward()
    assert loss.item() == pytest.approx(their_loss.item(), rel=1e-5)
    assert int(correct.sum()) / int(total.sum()) == pytest.approx(their_accuracy.item())
    theirs = dict(online.draft_model.named_parameters())
    for name, parameter in drafter.named_parameters():
        assert torch.allclose(parameter.grad, theirs[name].grad, rtol=1e-4, atol=1e-6), name


# -- the mask token -------------------------------------------------------------------------------


def test_mask_token_choice():
    """Both take the configured id, else the tokenizer's mask token. Without either, SpecForge
    takes the first embedding row past the tokenizer (len(tokenizer): 151,669 for Qwen3), the
    reference the last row (151,935), because it may have no tokenizer at all (rows carrying
    the server's token ids). Both are rows Qwen3 pads its embedding with and never emits; the
    id is saved in the checkpoint's config.json, which is what an inference engine must use."""
    vocab = 151936
    qwen3_like = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(151669))
    assert resolve_mask_token_id(explicit=None, tokenizer=qwen3_like,
                                 embedding_vocab_size=vocab) == 151669
    assert mask_token_id(TrainConfig(target_model="x"), qwen3_like, vocab) == vocab - 1
    for explicit in (7, 151700):
        assert resolve_mask_token_id(explicit=explicit, tokenizer=qwen3_like,
                                     embedding_vocab_size=vocab) == explicit
        assert mask_token_id(TrainConfig(target_model="x", mask_token_id=explicit), qwen3_like,
                             vocab) == explicit
    qwen3_like.add_special_tokens({"mask_token": "[MASK]"})
    assert resolve_mask_token_id(explicit=None, tokenizer=qwen3_like,
                                 embedding_vocab_size=vocab) == 151669 == \
        mask_token_id(TrainConfig(target_model="x"), qwen3_like, vocab)


def _word_tokenizer(size: int):
    """A tokenizers.Tokenizer with `size` contiguous ids, as Qwen3's 151,669."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
