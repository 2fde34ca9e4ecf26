"""Token sampling (megaloop/inference/sampling.py): a tiny positive temperature is greedy, not a NaN
traceback; ordinary temperatures sample softmax(logits / T) as before."""

import torch

from megaloop.inference.sampling import SamplingParams, pick_tokens


def test_a_tiny_temperature_picks_the_argmax():
    """`generate --temperature 1e-39` divided the logits to ±inf: softmax NaN, multinomial's RuntimeError."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 10
    for t in (1e-39, 5e-324, 1e-30):
        for top in ({}, {"top_k": 5}, {"top_p": 0.5}):
            got = pick_tokens(logits, SamplingParams(temperature=t, **top), torch.Generator().manual_seed(1))
            assert torch.equal(got, logits.argmax(-1)), (t, top)


def test_ordinary_temperatures_sample_as_before():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2))
    for t in (0.7, 1.0, 1.3):
        for seed in range(5):
            got = pick_tokens(logits, SamplingParams(temperature=t), torch.Generator().manual_seed(seed))
            want = torch.multinomial((logits / t).softmax(-1), 1, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(got, want.squeeze(-1)), (t, seed)
