"""What the decoder-family tests check of any transformers model against ours converted from it
(tests/model/test_family_blocks.py, tests/model/test_moe.py): the logits, left padding included,
the way back into the same class, and greedy generation with the cache."""

import warnings

import torch

from model.hf_decoders import gpt_from_hf_decoder, gpt_to_hf_decoder

ATOL = 1e-5
# What every tiny model of these tests shares (a family's own fields are added to it).
TINY_DECODER = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)  # fmt: skip


def tiny_hf_model(prefix: str, noise: float, **config):
    """transformers' `{prefix}ForCausalLM` of TINY_DECODER with `config`, seeded, every weight
    moved by normal noise of std `noise` (norms and biases away from 1 and 0, so that no mapping
    hides behind them), in eval mode."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(
        getattr(transformers, f"{prefix}Config")(**{**TINY_DECODER, **config})
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def left_padded(rows: int, length: int, seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (ids >= 3) with the second row's first three positions padding, and the mask."""
    x = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    x[1, :3] = 0
    return x, mask


def assert_into_ours_and_back(theirs, family: str, class_name: str, vocab: int):
    """Ours from `theirs` gives its logits (unpadded and left-padded); ours converted back is
    `class_name` with the same logits, and reads back into the same config. Returns ours."""
    ours = gpt_from_hf_decoder(theirs).eval()
    assert ours.cfg.family == family
    x, mask = left_padded(2, 20, seed=1, vocab=vocab)
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=1e-5, atol=ATOL)
        torch.testing.assert_close(
            ours(x, mask).logits[real],
            theirs(x, attention_mask=mask).logits[real],
            rtol=1e-5,
            atol=ATOL,
        )
    back = gpt_to_hf_decoder(ours).eval()
    assert type(back).__name__ == class_name
    with torch.no_grad():
        assert torch.equal(back(x).logits, theirs(x).logits)
    assert gpt_from_hf_decoder(back).cfg == ours.cfg
    return ours


def assert_greedy_equal(theirs, vocab: int, new_tokens: int = 14):
    """Three left-padded prompts of 6 tokens: our greedy continuations with the cache are
    transformers' `generate`'s, and differ from prompt to prompt."""
    ours = gpt_from_hf_decoder(theirs).eval()
    prompts, mask = left_padded(3, 6, seed=4, vocab=vocab)
    mine = ours.generate(prompts, mask, max_new_tokens=new_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = theirs.generate(
            prompts,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    assert torch.equal(mine, got)
    assert len(set(map(tuple, got[:, 6:].tolist()))) == 3
