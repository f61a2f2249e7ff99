"""Hugging Face `transformers` greedy decoding: the reference Subway's output must equal."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    tokens: list[int]
    top5: list[list[int]]  # the reference's top-5 ids at each generated position


_models: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if (path, dtype) not in _models:
        from transformers import AutoModelForCausalLM

        _models[path, dtype] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return _models[path, dtype]


def hf_greedy(
    path: str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> Reference:
    return model_greedy(hf_model(path, dtype), prompt, max_new_tokens)


@torch.no_grad()
def model_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Reference:
    """`model`'s greedy tokens after `prompt` (a transformers model, or a PEFT one)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,  # exact lengths: EOS is an ordinary token here
        do_sample=False,
        output_logits=True,  # raw logits: the top-5 a near-tie is judged by
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    top5 = [s[0].topk(5).indices.tolist() for s in out.logits]
    return Reference(tokens, top5)


def compare(ours: list[int], ref: Reference, our_top5: list[list[int]] | None = None) -> int:
    """Assert equality up to the first divergence at a verified near-tie; return 1 if one was tolerated.

    As in vLLM's model tests: a divergence is tolerated only where each side's
    token is in the other's top-5 (ours needs `our_top5`); the sequences are
    compared up to that point, since the contexts differ after it.
    """
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        if ours[i] != ref.tokens[i]:
            near_tie = ours[i] in ref.top5[i] and (
                our_top5 is not None and ref.tokens[i] in our_top5[i]
            )
            assert near_tie, f"diverged at {i}: ours {ours[i]} vs reference {ref.tokens[i]}"
            return 1
    assert len(ours) == len(ref.tokens), (len(ours), len(ref.tokens))
    return 0


def with_early_eos(src: str, dst: str, prompt: str, max_new: int, k: int = 3):
    """A copy of the model at `src` in `dst` with one more EOS id: the `k`-th greedy token
    after `prompt` (which neither the prompt nor the tokens before it hold), so that EOS
    and `ignore_eos` can be seen. Returns (the prompt's ids, that EOS id, the `max_new`
    greedy tokens, the tokenizer)."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    ids = tok.encode(prompt, add_special_tokens=True)
    greedy = hf_greedy(dst, ids, max_new).tokens
    eos = greedy[k]
    assert eos not in greedy[:k] and eos not in ids
    path = os.path.join(dst, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [2, eos]
    with open(path, "w") as f:
        json.dump(gen, f)
    return ids, eos, greedy, tok
