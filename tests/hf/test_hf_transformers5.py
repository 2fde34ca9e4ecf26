"""Exported HF folders under transformers 5.x (and the installed 4.x), megaloop not importable.

The export (``modeling_megaloop.py`` & co., loaded with ``trust_remote_code``) must work with
transformers 4.57 and 5.x. This file builds small exported folders (random perturbed weights, a
tiny BPE tokenizer, the real code files and tokenizer export), then runs the same checks

* in this interpreter's transformers (always), and
* in a transformers-5 interpreter named by ``MEGALOOP_TF5_PYTHON`` (skipped when unset), e.g.::

      python3.11 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install torch==2.13.0 "transformers>=5" \\
          safetensors tokenizers accelerate
      MEGALOOP_TF5_PYTHON=/tmp/tf5/bin/python pytest tests/hf/test_hf_transformers5.py

and compares both: logits to 1e-5, greedy tokens exactly. Checks (each export): plain forwards at
several ``num_recurrences``; greedy ``generate`` with ``terminal`` and ``per_visit`` caches equal to a
manual loop of forwards through the model's cache (logits and tokens), per-visit (and
``use_cache=False``) equal to the no-cache greedy loop; prefill/decode budgets given at load time;
a caller-supplied cache filled by ``generate``; ``inputs_embeds``; sampling, beams,
``num_return_sequences``; left-padded batches (explicit and tokenizer-made masks); the
``text-generation`` pipeline from the folder (its tokens equal ``generate``'s); ``save_pretrained``
and reload; bf16. The checks run as a script (``python -I this_file.py OUT.pt FOLDER ...``) in a
fresh process whose cwd is outside the repo and where ``import megaloop`` fails; they import only
torch, transformers and the standard library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TF5_ENV = "MEGALOOP_TF5_PYTHON"
TOL = 1e-5
N_NEW = 6
BASE = dict(vocab_size=256, tokenizer_vocab_size=120, hidden_size=64, num_attention_heads=4, n_prelude=1,
            n_core=2, n_coda=1, state_init_std=0.5, eval_seed=3, num_recurrences=3, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=0, pad_token_id=2)
VARIANTS = {  # name -> MegaloopConfig overrides
    "huginn_gqa_tied": dict(injection="huginn_linear", num_key_value_heads=2, tie_word_embeddings=True),
    "deq_per_visit_budgets": dict(injection="deq_qkv", kv_cache_mode="per_visit", prefill_recurrences=2,
                                  decode_recurrences=4),
    "untied": dict(arch="untied", num_hidden_layers=3),
}
# warnings our code must never cause (deprecated config attributes, renamed cache fields, bad kwargs)
BAD_WARNINGS = ("use_return_dict", "torch_dtype", "cache_params` are deprecated", "not used by the model",
                "is_compileable", "modeling_megaloop", "cache_megaloop", "configuration_megaloop")
COMPARED = ("logits_r1", "logits_r3", "logits_r6", "logits_default", "loss", "chunks_terminal", "chunks_per_visit",
            "genlogits_terminal", "genlogits_per_visit", "bf16_logits")
COMPARED_IDS = ("gen_terminal", "gen_per_visit", "gen_budgets", "gen_embeds", "batch_terminal", "batch_per_visit",
                "tok_batch", "bf16_gen")


# ============================================================================ checks (any interpreter)
def run_checks(folder: str) -> dict:
    """Every check on one exported folder; failures are collected in ``result["fail"]``."""
    import tempfile

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    res: dict = {"version": transformers.__version__, "fail": []}

    def check(cond, msg):
        if not cond:
            res["fail"].append(msg)

    def load(path=folder, **kw):
        kw.setdefault("dtype", torch.float32)
        m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()
        check(type(m).__module__.startswith("transformers_modules."), f"loaded from {type(m).__module__}")
        m.generation_config.eos_token_id = None  # always N_NEW tokens, as the manual loops below
        return m

    def pick(logits):  # greedy over the tokenizer's ids (generate suppresses the padded rows)
        return logits[..., :vocab].argmax(-1)

    def nocache_loop(m, ids, n, **kw):
        seq = ids
        for _ in range(n):
            seq = torch.cat([seq, pick(m(seq, use_cache=False, **kw).logits[:, -1:])], 1)
        return seq

    def cached_logits(m, ids, seq, mode, prefill=None, decode=None):
        """Last-position logits of a manual prefill + one-token decode loop through a fresh cache."""
        cache = m.new_cache(mode)
        out = [m(ids, past_key_values=cache, num_recurrences=prefill).logits[:, -1]]
        for t in range(ids.shape[1], seq.shape[1] - 1):
            out.append(m(seq[:, t:t + 1], past_key_values=cache, num_recurrences=decode).logits[:, -1])
        return torch.stack(out, 1)

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    vocab = cfg.tokenizer_vocab_size
    model = load()
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    looped = cfg.arch == "looped"

    def t_forward():
        for r in (1, 3, 6):
            res[f"logits_r{r}"] = model(ids, use_cache=False, num_recurrences=r).logits
        res["logits_default"] = model(ids, use_cache=False).logits
        check(torch.equal(model(ids, use_cache=False, return_dict=False)[0], res["logits_default"]), "tuple output")
        out = model(ids, use_cache=False, num_recurrences=4, output_hidden_states=True)
        check(len(out.hidden_states) == (2 + 4 + 1 if looped else 2), "hidden_states count")
        res["loss"] = model(ids, labels=ids).loss
        check(bool(torch.isfinite(res["loss"])), "labels loss")
        enc = tok(["hello world", "looped models"], return_tensors="pt", padding=True)
        check(model(**enc).logits.shape[:2] == enc["input_ids"].shape, "forward(**tokenizer output)")

    def t_generate():
        for mode in ("terminal", "per_visit"):
            m = load(kv_cache_mode=mode)
            gen = m.generate(ids, max_new_tokens=N_NEW, do_sample=False)
            out = m.generate(ids, max_new_tokens=N_NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
            check(torch.equal(out.sequences, gen), f"{mode}: return_dict_in_generate sequences")
            lg = torch.stack(out.logits, 1)
            ref = cached_logits(m, ids, gen, mode)
            check((lg - ref).abs().max().item() < TOL, f"{mode}: generate logits != manual cached loop")
            check(torch.equal(gen[:, ids.shape[1]:], pick(ref)), f"{mode}: generate tokens != manual loop")
            res[f"gen_{mode}"], res[f"genlogits_{mode}"] = gen, lg
            nocache = nocache_loop(m, ids, N_NEW)
            if (mode == "per_visit" or not looped) and cfg.prefill_depth == cfg.decode_depth:
                check(torch.equal(gen, nocache), f"{mode}: generate != no-cache greedy loop")  # = parallel forward
            check(torch.equal(m.generate(ids, max_new_tokens=N_NEW, do_sample=False, use_cache=False), nocache),
                  f"{mode}: generate(use_cache=False) != no-cache greedy loop")
            cache = m.new_cache(mode)
            again = m.generate(ids, max_new_tokens=N_NEW, do_sample=False, past_key_values=cache)
            check(torch.equal(again, gen), f"{mode}: generate(past_key_values=new_cache()) differs")
            check(cache.get_seq_length() == ids.shape[1] + N_NEW - 1, f"{mode}: passed cache not filled")
        m = load(num_recurrences=5, prefill_recurrences=2, decode_recurrences=4, kv_cache_mode="terminal")
        check((m.config.num_recurrences, m.config.decode_recurrences) == (5, 4), "load-time budget overrides")
        gen = m.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        ref = cached_logits(m, ids, gen, "terminal", prefill=2, decode=4)
        check(torch.equal(gen[:, ids.shape[1]:], pick(ref)), "budgets: generate != manual loop at P=2, D=4")
        res["gen_budgets"] = gen
        deep = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, use_cache=False, num_recurrences=8)
        check(torch.equal(deep, nocache_loop(model, ids, N_NEW, num_recurrences=8)), "generate(num_recurrences=8)")
        emb = model.get_input_embeddings()(ids)
        res["gen_embeds"] = model.generate(inputs_embeds=emb, max_new_tokens=N_NEW, do_sample=False)[:, -N_NEW:]
        base = model.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        check(torch.equal(res["gen_embeds"], base[:, -N_NEW:]), "generate(inputs_embeds) != generate(input_ids)")
        short = model.generate(ids[:1], max_length=ids.shape[1] + 3, do_sample=False)
        check(short.shape[1] <= ids.shape[1] + 3, "max_length")

    def t_sample():
        torch.manual_seed(0)
        s = model.generate(ids, max_new_tokens=N_NEW, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
        check(s.shape == (2, ids.shape[1] + N_NEW) and torch.equal(s[:, :ids.shape[1]], ids), "sample shape")
        check(int(s.max()) < vocab, "sampled a padded-vocabulary id (suppress_tokens)")
        torch.manual_seed(0)
        check(torch.equal(s, model.generate(ids, max_new_tokens=N_NEW, do_sample=True, top_k=20, top_p=0.9,
                                            temperature=0.8)), "seeded sampling not reproducible")
        beams = model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
        check(beams.shape == (2, ids.shape[1] + 3), f"beam search shape {tuple(beams.shape)}")
        many = model.generate(ids[:1], max_new_tokens=3, do_sample=True, num_return_sequences=3)
        check(many.shape == (3, ids.shape[1] + 3), "num_return_sequences")

    def t_batch():
        for mode in ("terminal", "per_visit"):
            m = load(kv_cache_mode=mode)
            short = ids[1:, 4:]
            batch = torch.cat([ids[:1], torch.cat([torch.full((1, 4), tok.pad_token_id), short], 1)])
            mask = torch.ones_like(batch)
            mask[1, :4] = 0
            both = m.generate(batch, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
            one = m.generate(ids[:1], max_new_tokens=N_NEW, do_sample=False)
            two = m.generate(short, max_new_tokens=N_NEW, do_sample=False)
            check(torch.equal(both[0], one[0]) and torch.equal(both[1, 4:], two[0]), f"{mode}: left-padded batch")
            res[f"batch_{mode}"] = both
        tok.padding_side = "left"
        enc = tok(["hello world , looped models", "think"], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
        alone = model.generate(tok(["think"], return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False)
        check(torch.equal(out[1, -alone.shape[1]:], alone[0]), "tokenizer-padded batch row != alone")
        res["tok_batch"] = out
        res["decoded"] = tok.batch_decode(out, skip_special_tokens=True)
        # the text-generation pipeline from the folder alone, as a transformers user runs it
        from transformers import pipeline

        pipe = pipeline("text-generation", model=folder, trust_remote_code=True, device="cpu")
        check(type(pipe.model).__module__.startswith("transformers_modules."), "pipeline: not the export's model")
        prompt = tok(["think"], return_tensors="pt").input_ids
        ref = pipe.model.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist()
        got = pipe("think", max_new_tokens=4, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
        check(list(got) == ref, f"pipeline tokens {list(got)} != generate's {ref}")
        text = pipe("think", max_new_tokens=4, do_sample=False)[0]["generated_text"]
        check(text.startswith("think"), f"pipeline text {text!r}")  # how it joins prompt and new text varies

    def t_save():
        with tempfile.TemporaryDirectory() as d:
            load(num_recurrences=4, kv_cache_mode="per_visit").save_pretrained(d)
            tok.save_pretrained(d)
            for f in ("config.json", "modeling_megaloop.py", "cache_megaloop.py", "configuration_megaloop.py"):
                check(os.path.isfile(os.path.join(d, f)), f"save_pretrained: {f} missing")
            again = load(d)
            check((again.config.num_recurrences, again.config.kv_cache_mode) == (4, "per_visit"), "saved overrides")
            check(torch.equal(again(ids, use_cache=False, num_recurrences=3).logits, res["logits_r3"]),
                  "save_pretrained + reload changes logits")
            AutoTokenizer.from_pretrained(d, trust_remote_code=True)

    def t_bf16():
        m = load(dtype=torch.bfloat16)
        check(m.dtype == torch.bfloat16 and m.lm_head.weight.dtype == torch.bfloat16, f"bf16 load: {m.dtype}")
        lg = m(ids, use_cache=False).logits
        check(lg.dtype == torch.bfloat16, "bf16 logits dtype")
        res["bf16_logits"] = lg.float()
        err = (lg.float() - res["logits_default"]).abs().max().item()
        check(err < 0.1 * max(1.0, res["logits_default"].abs().max().item()), f"bf16 far from fp32: {err:.3g}")
        res["bf16_gen"] = m.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        load(dtype=torch.bfloat16, kv_cache_mode="per_visit").generate(ids, max_new_tokens=2, do_sample=False)

    def t_cache_api():
        full = model(ids, use_cache=False, num_recurrences=3).logits
        for mode in ("terminal", "per_visit"):
            cache = model.new_cache(mode)
            first = model(ids[:, :8], past_key_values=cache, num_recurrences=3)
            check(first.to_tuple()[1] is cache, "output does not carry the passed cache")
            rest = model(ids[:, 8:], past_key_values=cache, num_recurrences=3).logits
            got = torch.cat([first.logits, rest], 1)
            if mode == "per_visit" or not looped:
                check((got - full).abs().max().item() < TOL, f"{mode}: chunked prefill != parallel forward")
            check(cache.get_seq_length() == ids.shape[1], f"{mode}: cache length")
            res[f"chunks_{mode}"] = got
        cache = model.new_cache()
        model(ids, cache=cache)  # the name recent transformers 5.x use
        check(cache.get_seq_length() == ids.shape[1], "forward(cache=...)")
        check(model(ids).to_tuple()[1].get_seq_length() == ids.shape[1], "default use_cache=True cache")
        cache = model.new_cache()
        model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
        check(cache.get_seq_length() == ids.shape[1] + 2, "generate(cache=...) did not fill the cache")

    for name, fn in [("forward", t_forward), ("generate", t_generate), ("sample", t_sample), ("batch", t_batch),
                     ("save", t_save), ("bf16", t_bf16), ("cache_api", t_cache_api)]:
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # noqa: BLE001 - report every failing check, not just the first
            import traceback

            res["fail"].append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
    return res


def main(argv: list[str]) -> int:
    """``python -I test_hf_transformers5.py OUT.pt FOLDER ...``: run_checks on each folder, megaloop blocked."""
    import importlib.abc
    import logging
    import warnings

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("megaloop", "megatron"):
                raise ImportError(f"{name} is blocked in this isolated check")
            return None

    sys.meta_path.insert(0, _Block())
    sys.modules["sklearn"] = None  # transformers' optional sklearn import costs seconds
    import torch
    import transformers

    torch.set_num_threads(1)
    caught: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                caught.append(f"{record.name}: {record.getMessage()}")

    transformers.logging.get_logger("transformers").addHandler(_Handler())
    warnings.simplefilter("always")
    warnings.showwarning = lambda msg, cat, file, line, *a, **k: caught.append(f"{cat.__name__}: {msg} ({file})")
    result = {"version": transformers.__version__, "folders": {}}
    for folder in argv[1:]:
        result["folders"][folder] = run_checks(folder)
    result["warnings"] = sorted(set(caught))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("megaloop", "megatron"))
    result["leaked"] = leaked
    torch.save(result, argv[0])
    print(f"CHECKS DONE transformers {transformers.__version__}", flush=True)
    return 0


# ============================================================================ pytest side
_RUNS: dict = {}


def _exports(tmp_root: Path) -> dict[str, Path]:
    """Build every variant's exported folder once per session (this interpreter, megaloop available)."""
    if "exports" in _RUNS:
        return _RUNS["exports"]
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megaloop.hf import MegaloopConfig, MegaloopForCausalLM
    from megaloop.hf.convert import AUTO_MAP, CODE_FILES, HF_DIR, save_tokenizer

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=BASE["tokenizer_vocab_size"], show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|bos|>", "<|pad|>", "<unk>"])
    raw.train_from_iterator(["hello world, looped models think longer and deeper"] * 20, trainer=trainer)
    assert raw.get_vocab_size() <= BASE["tokenizer_vocab_size"]
    tok_json = tmp_root / "tokenizer.json"
    raw.save(str(tok_json))
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = MegaloopForCausalLM(MegaloopConfig(**{**BASE, **overrides}, architectures=["MegaloopForCausalLM"],
                                                   auto_map=dict(AUTO_MAP))).eval()
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # off the init (identity W, unit gains): terminal sharing then changes logits
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        gen = model.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = 1, 0, 2
        gen.suppress_tokens = list(range(BASE["tokenizer_vocab_size"], BASE["vocab_size"]))
        folder = tmp_root / name
        model.save_pretrained(str(folder))
        for f in CODE_FILES:
            shutil.copyfile(HF_DIR / f, folder / f)
        save_tokenizer(tok_json, folder, {"eos": 0, "bos": 1, "pad": 2}, BASE["max_position_embeddings"])
        out[name] = folder
    _RUNS["exports"] = out
    return out


def _run(python: str, folders: dict[str, Path], tmp_root: Path, tag: str) -> dict:
    """Run the checks in ``python`` (isolated, cwd outside the repo, no PYTHONPATH, offline)."""
    import torch

    if tag in _RUNS:
        return _RUNS[tag]
    work = tmp_root / f"run_{tag}"
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="0")
    result = work / "result.pt"
    proc = subprocess.run([python, "-I", __file__, str(result), *map(str, folders.values())], cwd=work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "CHECKS DONE" in proc.stdout, \
        f"{python} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    _RUNS[tag] = torch.load(result)
    return _RUNS[tag]


def _assert_clean(run: dict, folders: dict[str, Path]) -> None:
    who = f"transformers {run['version']}"
    assert not run["leaked"], f"{who}: megaloop/megatron imported: {run['leaked']}"
    fails = [f"[{name}] {msg}" for name, f in folders.items() for msg in run["folders"][str(f)]["fail"]]
    assert not fails, f"{who}: {len(fails)} failed checks:\n" + "\n".join(fails)
    bad = [w for w in run["warnings"] if any(b in w for b in BAD_WARNINGS)]
    assert not bad, f"{who}: warnings caused by the export's code:\n" + "\n".join(bad)


def _tf5_python() -> str:
    import pytest

    python = os.environ.get(TF5_ENV)
    if not python:
        pytest.skip(f"{TF5_ENV} is not set: point it at a python with torch, transformers>=5, tokenizers and "
                    "safetensors (megaloop not needed) to check the export under transformers 5")
    proc = subprocess.run([python, "-I", "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        pytest.fail(f"{TF5_ENV}={python} cannot import transformers:\n{proc.stderr[-2000:]}")
    version = proc.stdout.strip().splitlines()[-1]
    if int(version.split(".")[0]) < 5:
        pytest.skip(f"{TF5_ENV}={python} has transformers {version}, not 5.x")
    return python


def test_export_checks_installed_transformers(tmp_path_factory):
    """The checks pass in this interpreter's transformers (the version the export is written with)."""
    root = _RUNS.setdefault("root", tmp_path_factory.mktemp("hf_tf5"))
    folders = _exports(root)
    _assert_clean(_run(sys.executable, folders, root, "here"), folders)


def test_export_checks_transformers5_match_installed(tmp_path_factory):
    """The checks pass under transformers 5 and give the same numbers as here (logits 1e-5, tokens)."""
    python = _tf5_python()
    root = _RUNS.setdefault("root", tmp_path_factory.mktemp("hf_tf5"))
    folders = _exports(root)
    here = _run(sys.executable, folders, root, "here")
    tf5 = _run(python, folders, root, "tf5")
    _assert_clean(tf5, folders)
    for name, folder in folders.items():
        a, b = here["folders"][str(folder)], tf5["folders"][str(folder)]
        for key in COMPARED:
            err = (a[key].float() - b[key].float()).abs().max().item()
            assert err <= TOL, f"[{name}] {key}: transformers {a['version']} vs {b['version']} differ by {err:.3g}"
        for key in COMPARED_IDS:
            assert a[key].tolist() == b[key].tolist(), f"[{name}] {key}: tokens differ across versions"
        assert a["decoded"] == b["decoded"], f"[{name}] decoded text differs"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
