"""Pure-PyTorch HF model: KV caches (terminal / per-visit), prefill/decode budgets, generate.

No megatron here: models are built from ``MegaloopConfig`` with perturbed random weights. The
terminal-sharing reference below is written independently of the modeling code (explicit loops
over tokens, keys and heads).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaloop.hf import MegaloopConfig, MegaloopForCausalLM

INJECTIONS = ("huginn_linear", "parcae_decay", "parcae_nonorm", "orthoinj", "deq_qkv")
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_model(injection="parcae_decay", arch="looped", seed=0, **kw) -> MegaloopForCausalLM:
    base = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                n_prelude=1, n_core=2, n_coda=1, num_hidden_layers=3, injection=injection, arch=arch,
                state_init_std=0.5, eval_seed=3, num_recurrences=4)
    base.update(kw)
    torch.manual_seed(seed)
    model = MegaloopForCausalLM(MegaloopConfig(**base))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move every parameter off its init (identity W, unit gains, ...)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.float().eval()


# ----------------------------------------------------------------------------- reference
def _rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def _rope(x, pos, base):  # x [heads, hd], one token at absolute position pos
    hd = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(layer, cfg, xs, pos, prefix, e=None):
    """One layer over new tokens xs [n, d] at positions pos, keys = prefix [m] + causal new."""
    att, nh, nkv, hd = layer.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    xn = _rms(xs, layer.input_layernorm.weight, cfg.rms_norm_eps)
    q, k, v = xn @ att.q_proj.weight.T, xn @ att.k_proj.weight.T, xn @ att.v_proj.weight.T
    if e is not None:
        q, k, v = q + e @ att.q_inject.weight.T, k + e @ att.k_inject.weight.T, v + e @ att.v_inject.weight.T
    n = xs.shape[0]
    q = torch.stack([_rope(q[i].view(nh, hd), pos[i], cfg.rope_theta) for i in range(n)])
    k = torch.stack([_rope(k[i].view(nkv, hd), pos[i], cfg.rope_theta) for i in range(n)])
    v = v.view(n, nkv, hd)
    K, V = torch.cat([prefix[0], k]), torch.cat([prefix[1], v])
    m = prefix[0].shape[0]
    out = torch.zeros(n, nh, hd)
    for i in range(n):
        for h in range(nh):
            g = h // (nh // nkv)
            scores = K[: m + i + 1, g] @ q[i, h] / math.sqrt(hd)
            out[i, h] = torch.softmax(scores, 0) @ V[: m + i + 1, g]
    x = xs + out.reshape(n, nh * hd) @ att.o_proj.weight.T
    mlp = layer.mlp
    xn = _rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    x = x + (F.silu(xn @ mlp.gate_proj.weight.T) * (xn @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return x, k, v


def _inject(inj, cfg, h, e):
    name = cfg.injection
    if name == "huginn_linear":
        return torch.cat([h, e], -1) @ inj.adapter.weight.T + inj.adapter.bias
    if name == "deq_qkv":
        return h
    et = _rms(e, inj.norm_weight, cfg.rms_norm_eps) if name == "parcae_decay" else e
    delta = F.softplus(inj.delta_raw)
    q = delta * (et @ inj.proj.T)
    carry = torch.exp(-delta * torch.exp(inj.alpha_log)) * h
    if name == "orthoinj":
        carry = carry - q * (q * carry).sum(-1, keepdim=True) / ((q * q).sum(-1, keepdim=True) + 1e-6)
    return carry + q


@torch.no_grad()
def terminal_reference(model, ids, chunks):
    """Logits of ``ids`` [T] fed as ``chunks`` [(length, depth)]: each chunk is the parallel pass
    over its tokens, reading earlier tokens only through their *terminal* KV banks."""
    cfg, mm = model.config, model.model
    empty = (torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim),) * 2
    banks: dict = {}
    logits, start = [], 0
    for length, depth in chunks:
        pos = list(range(start, start + length))
        x = mm.embed_tokens.weight[ids[start:start + length]]
        new = {}

        def stack(group, layers, x):
            for i, layer in enumerate(layers):
                x, k, v = _layer(layer, cfg, x, pos, banks.get((group, i), empty))
                new[(group, i)] = (k, v)
            return x

        x = stack("prelude", mm.prelude, x)
        e = x
        h = torch.stack([torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(
            cfg.eval_seed * 1_000_003 + t)) for t in pos]) * cfg.state_init_std
        for r in range(depth):
            z = _inject(mm.injection, cfg, h, e)
            for i, layer in enumerate(mm.core):
                z, k, v = _layer(layer, cfg, z, pos, banks.get(("core", i), empty),
                                 e if cfg.injection == "deq_qkv" else None)
                if r == depth - 1:
                    new[("core", i)] = (k, v)
            h = _rms(z, None, cfg.exit_norm_eps) if cfg.injection == "huginn_linear" else z
        x = stack("coda", mm.coda, h)
        logits.append(_rms(x, mm.norm.weight, cfg.rms_norm_eps) @ model.lm_head.weight.T)
        for key, (k, v) in new.items():
            old = banks.get(key, empty)
            banks[key] = (torch.cat([old[0], k]), torch.cat([old[1], v]))
        start += length
    return torch.cat(logits)


def run_chunks(model, ids, chunks, mode):
    cache = model.new_cache(mode)
    outs, start = [], 0
    with torch.no_grad():
        for length, depth in chunks:
            out = model(ids[:, start:start + length], past_key_values=cache, num_recurrences=depth)
            outs.append(out.logits)
            start += length
    return torch.cat(outs, dim=1), cache


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("injection", INJECTIONS)
def test_terminal_decoding_matches_explicit_reference(injection):
    model = make_model(injection)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(7))
    # prefill 4 tokens at P=3, decode 3 tokens at D=5, a 2-token chunk on the cache, one more token
    chunks = [(4, 3), (1, 5), (1, 5), (1, 5), (2, 3), (1, 2)]
    got, cache = run_chunks(model, ids, chunks, "terminal")
    ref = terminal_reference(model, ids[0], chunks)
    err = (got[0] - ref).abs().max().item()
    assert err < TOL, f"{injection}: terminal decoding vs reference max abs {err:.2e}"
    assert cache.get_seq_length() == 10 and cache.num_banks() == 4


@pytest.mark.parametrize("injection", INJECTIONS)
def test_per_visit_decoding_equals_parallel_forward(injection):
    model = make_model(injection)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(8))
    R = 4
    with torch.no_grad():
        full = model(ids, use_cache=False, num_recurrences=R).logits
    got, cache = run_chunks(model, ids, [(3, R)] + [(1, R)] * 4 + [(2, R)], "per_visit")
    err = (got - full).abs().max().item()
    assert err < TOL, f"{injection}: per-visit decoding vs parallel forward max abs {err:.2e}"
    assert cache.num_banks() == 1 + 2 * R + 1
    # one token at a time from the start
    got1, _ = run_chunks(model, ids, [(1, R)] * 9, "per_visit")
    assert (got1 - full).abs().max().item() < TOL


def test_prefill_is_the_parallel_pass_and_keeps_terminal_banks():
    model = make_model("huginn_linear")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(9))
    P = 3
    with torch.no_grad():
        full = model(ids, use_cache=False, num_recurrences=P).logits
        term, pv = model.new_cache("terminal"), model.new_cache("per_visit")
        a = model(ids, past_key_values=term, num_recurrences=P).logits
        b = model(ids, past_key_values=pv, num_recurrences=P).logits
    assert (a - full).abs().max().item() < TOL and (b - full).abs().max().item() < TOL
    # terminal mode keeps, for each core layer, the KV of the last recurrence of the parallel pass
    for i in range(2):
        for t, p in zip(term.read("core", i, 0), pv.banks[("core", i, P - 1)].view()):
            assert torch.equal(t, p)
    for key in (("prelude", 0, 0), ("coda", 0, 0)):
        assert all(torch.equal(x, y) for x, y in zip(term.banks[key].view(), pv.banks[key].view()))
    assert term.num_banks() == 4 and pv.num_banks() == 1 + 2 * P + 1
    # a later token at decode depth D > P reads the prefix's terminal banks at every recurrence
    nxt = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        d = model(nxt, past_key_values=term, num_recurrences=5).logits
    ref = torch.stack([terminal_reference(model, torch.cat([ids, nxt], 1)[j], [(7, P), (1, 5)])[-1]
                       for j in range(2)])
    assert (d[:, -1] - ref).abs().max().item() < TOL


def test_budgets_from_config_and_overrides(tmp_path):
    model = make_model("parcae_decay", num_recurrences=5, prefill_recurrences=2, decode_recurrences=3)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        cache = model.new_cache()
        out = model(ids, past_key_values=cache, output_hidden_states=True)
        assert len(out.hidden_states) == 2 + 2 + 1  # embedding, e, h^1..h^P, coda output
        out = model(ids[:, :1], past_key_values=cache, output_hidden_states=True)
        assert len(out.hidden_states) == 2 + 3 + 1  # decode budget
        out = model(ids, use_cache=False, output_hidden_states=True)
        assert len(out.hidden_states) == 2 + 2 + 1  # no cache: a plain forward uses the prefill budget
        out = model(ids, use_cache=False, num_recurrences=7, output_hidden_states=True)
        assert len(out.hidden_states) == 2 + 7 + 1
    model.save_pretrained(tmp_path)
    again = MegaloopForCausalLM.from_pretrained(tmp_path, num_recurrences=8, kv_cache_mode="per_visit",
                                                prefill_recurrences=None)
    assert again.config.num_recurrences == 8 and again.config.kv_cache_mode == "per_visit"
    with torch.no_grad():
        a = again(ids, use_cache=False).logits
        b = model(ids, use_cache=False, num_recurrences=8).logits
    assert (a - b).abs().max().item() < TOL


def test_kv_bytes_per_token_terminal_is_4_of_12():
    model = make_model("orthoinj", n_prelude=1, n_core=2, n_coda=1)
    t, pv = model.kv_bytes_per_token("terminal"), model.kv_bytes_per_token("per_visit", num_recurrences=5)
    assert t * 12 == pv * 4
    assert t == 4 * 2 * 2 * 16 * 4  # banks × (K,V) × kv heads × head dim × fp32 bytes
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        term = model.new_cache("terminal")
        model(ids, past_key_values=term, num_recurrences=5)
        model(ids[:, :1], past_key_values=term, num_recurrences=5)
        per = model.new_cache("per_visit")
        model(ids, past_key_values=per, num_recurrences=5)
    assert term.kv_bytes_per_token() == t and per.kv_bytes_per_token() == pv
    assert term.num_banks() == 4 and per.num_banks() == 12


def test_generate_greedy_equals_manual_loop():
    model = make_model("deq_qkv", num_recurrences=3, decode_recurrences=2)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(13))
    n = 6
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, do_sample=False)
        cache = model.new_cache()
        logits = model(ids, past_key_values=cache).logits
        seq = ids
        for _ in range(n):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, past_key_values=cache).logits
        assert torch.equal(gen, seq)
        # use_cache=False: every step is the full parallel forward at num_recurrences
        gen_nc = model.generate(ids, max_new_tokens=n, do_sample=False, use_cache=False)
        seq = ids
        for _ in range(n):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        assert torch.equal(gen_nc, seq)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=4, do_sample=True, top_k=8, temperature=0.9)
        assert sampled.shape == (2, 9) and torch.equal(sampled[:, :5], ids)
        beams = model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
        assert beams.shape == (2, 8)


def test_generate_per_visit_equals_uncached_and_left_padding():
    model = make_model("huginn_linear", num_recurrences=3, kv_cache_mode="per_visit")
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=5, do_sample=False)
        b = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
        assert torch.equal(a, b)
        model.config.kv_cache_mode = "terminal"  # a caller-supplied cache picks the mode per call
        c = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=model.new_cache("per_visit"))
        assert torch.equal(a, c)
        # terminal mode, batch with left padding == each sequence on its own
        model.config.kv_cache_mode = "terminal"
        short = ids[1:, 2:]
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1)
        batch = torch.cat([ids[:1], padded])
        mask = torch.ones_like(batch)
        mask[1, :2] = 0
        both = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        one = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        two = model.generate(short, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(both[0], one[0]) and torch.equal(both[1, 2:], two[0])



@pytest.mark.parametrize("injection", ["parcae_decay", "deq_qkv"])
def test_a_left_padded_forward_scores_as_each_sequence_alone(injection):
    """model(**tokenizer(batch, padding=True)) without position_ids: the padded row's positions (its
    eval h⁰ and RoPE) started at the padding, so its logits differed from the row alone (by 1.5 for
    deq_qkv); they are counted over the unpadded tokens now, as generate counts them."""
    model = make_model(injection, num_recurrences=3)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(21))
    batch, mask = ids.clone(), torch.ones_like(ids)
    batch[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        both = model(batch, attention_mask=mask, use_cache=False).logits
        alone = model(ids[1:, 3:], use_cache=False).logits
        first = model(ids[:1], use_cache=False).logits
    assert (both[1, 3:] - alone[0]).abs().max().item() < TOL
    assert (both[0] - first[0]).abs().max().item() < TOL

def test_untied_arch_cache_and_tied_head():
    model = make_model(arch="untied", num_hidden_layers=3, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        got, cache = run_chunks(model, ids, [(3, 1), (1, 1), (2, 1)], "terminal")
    assert (got - full).abs().max().item() < TOL and cache.num_banks() == 3
    assert model.kv_bytes_per_token("per_visit", 5) == model.kv_bytes_per_token("terminal")


def test_eval_state_init_zero_and_train_mode():
    model = make_model("parcae_nonorm", eval_state_init="zero")
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        zero_a = model(ids, use_cache=False).logits
        model.config.eval_seed = 99  # zero init does not depend on the eval seed
        zero_b = model(ids, use_cache=False).logits
        model.config.eval_state_init = "normal"
        normal_a = model(ids, use_cache=False).logits
        model.config.eval_seed = 3
        normal_b = model(ids, use_cache=False).logits
        model.train()
        a = model(ids, use_cache=False).logits
        b = model(ids, use_cache=False).logits
    assert torch.equal(zero_a, zero_b)
    assert not torch.equal(normal_a, normal_b) and not torch.equal(zero_a, normal_b)
    assert not torch.equal(a, b)  # train mode draws fresh noise (state_init=normal)


def test_labels_loss_with_num_items_in_batch_matches_a_full_batch():
    """HF Trainer with gradient accumulation: forward takes ``**kwargs``, so Trainer passes
    ``num_items_in_batch`` and stops dividing by the accumulation steps; the model must return the CE
    sum over that count. It returned each micro-batch's mean: loss and gradients were multiplied by
    the accumulation steps (audit L: logged loss 23.14 at GA=4 for 5.78 at GA=1)."""
    torch.manual_seed(0)
    model = make_model()
    ids = torch.randint(0, model.config.vocab_size, (4, 12))
    labels = ids.clone()
    labels[0, :5] = -100  # uneven counts across the micro-batches
    labels[3, 7:] = -100
    full = model(ids, labels=labels).loss
    items = int((labels[:, 1:] != -100).sum())
    parts = [model(ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=torch.tensor(items)).loss
             for i in (0, 2)]
    assert torch.allclose(sum(parts), full, rtol=1e-5, atol=1e-6)
    assert torch.allclose(model(ids, labels=labels, num_items_in_batch=items).loss, full, rtol=1e-5)
