"""A user's HuggingFace model for the `hf` tox env: GPT-2 from a config (no download), its
default dropout (0.1) on, its own initialisation and its own loss (`labels=`)."""

from __future__ import annotations

import torch


def build():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, eos_token_id=0, bos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(rank, step, micro):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(100 * rank + 10 * step + micro))
    return {"input_ids": ids, "labels": ids}


def loss(output):
    return output.loss
