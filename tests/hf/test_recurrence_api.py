"""The export model's recurrence API (``LoopedPass``) is the one way to walk a looped model:
it reproduces the model's own forward, and no module outside ``hf/modeling_megaloop.py`` reaches
into the model's prelude / core / injection / coda (they live in ``hf/modeling_megaloop.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.post.rl.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"prelude", "core", "coda", "injection"}
# the export model itself (and its recurrence API); the native megatron model (its own modules, its own methods); the parity
# harness's adapters of the reference implementations (their models, not megaloop's)
EXEMPT = {"megaloop/hf/modeling_megaloop.py", "tools/bench/parity_refs.py"}
EXEMPT_DIRS = ("megaloop/model/",)


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _violations(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=rel)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in PARTS):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue  # a module's own submodule (e.g. a prefill student's own injection)
        if _root_name(node) == "megatron":
            continue  # megatron.core.…
        parent = parents.get(node)
        if node.attr == "injection":  # also a config field (a string): flag only use as a module
            used = isinstance(parent, ast.Call) and parent.func is node
            used |= isinstance(parent, ast.Attribute) or isinstance(parent, ast.Subscript)
            if not used:
                continue
        out.append(f"{rel}:{node.lineno}: .{node.attr}")
    return out


def test_no_module_walks_the_model_by_hand():
    found = []
    for base in ("megaloop", "tools"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in EXEMPT or rel.startswith(EXEMPT_DIRS):
                continue
            found += _violations(path, rel)
    assert not found, "use the recurrence API (MegaloopModel.begin / LoopedPass) instead of:\n" + "\n".join(found)


def test_the_scan_finds_a_walker(tmp_path):
    bad = tmp_path / "walker.py"
    bad.write_text("def f(m, h, ctx):\n    z = m.model.injection(h, ctx)\n    return m.model.core[0], cfg.injection\n")
    assert [v.split(": ")[1] for v in _violations(bad, "walker.py")] == [".injection", ".core"]


@pytest.mark.parametrize("injection", ["parcae_decay", "huginn_linear", "deq_qkv"])
def test_pass_equals_forward(injection):
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.manual_seed(0)
    model = MegaloopForCausalLM(tiny_config(injection=injection, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, use_cache=False, num_recurrences=4, output_hidden_states=True)
        p = model.begin(ids)
        h = p.init_state()
        states = [h]
        for r in range(4):
            h, kv = p.step(h, r)
            states.append(h)
        logits, coda_kv = p.readout(h)
        assert len(kv) == model.config.n_core and len(coda_kv) == model.config.n_coda
        assert torch.equal(p.e, ref.hidden_states[1])
        for a, b in zip(states[1:], ref.hidden_states[2:6]):
            assert torch.equal(a, b)
        assert torch.allclose(logits, ref.logits, atol=1e-6, rtol=0)
        # a row subset of the pass computes exactly those rows
        idx = torch.tensor([2, 0])
        sub = p.rows(idx)
        h_sub, _ = sub.step(states[2][idx], 2)
        assert torch.allclose(h_sub, states[3][idx], atol=1e-6, rtol=0)
        # a pass over a given e (no prelude) continues identically
        q = model.begin(e=p.e)
        assert torch.equal(q.step(states[1], 1)[0], states[2])


def test_pass_reads_a_cache_without_writing_it():
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.manual_seed(0)
    model = MegaloopForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache("terminal")
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache, num_recurrences=3)
        n_before = cache.get_seq_length()
        ref = model(ids[:, -1:], past_key_values=cache, num_recurrences=3).logits
        cache.crop(n_before)
        p = model.begin(ids[:, -1:], past=cache)
        h = p.init_state()
        for r in range(3):
            h, _ = p.step(h, r)
        logits, _ = p.readout(h)
    assert cache.get_seq_length() == n_before
    assert p.positions.tolist() == [[n_before], [n_before]]
    assert torch.allclose(logits, ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="exactly one"):
        model.begin(ids, e=p.e)
