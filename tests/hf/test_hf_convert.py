"""megaloop checkpoint → HF folder: every injection (+ untied arch, tied head, GQA), loaded in a
fresh isolated interpreter where ``import megaloop`` fails; TP=2 / PP=2 checkpoints; bad inputs;
HF → megaloop round trip."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, bpe_tokenizer, run_torchrun

TOL = 1e-4
VOCAB = 250  # padded to 256
VARIANTS = {  # name -> ModelConfig overrides
    "huginn_linear": dict(injection="huginn_linear", num_query_groups=2),
    "parcae_decay": dict(injection="parcae_decay", tie_embeddings=True),
    "parcae_nonorm": dict(injection="parcae_nonorm", eval_state_init="zero"),
    "orthoinj": dict(injection="orthoinj", bf16=True),  # bf16 run: tensors upcast to FP32 on conversion
    "deq_qkv": dict(injection="deq_qkv", num_query_groups=2, n_prelude=2),
    "untied": dict(arch="untied", num_layers=3),
    "huginn_no_exit_norm": dict(injection="huginn_linear", exit_norm=False),  # paper-only variants
    "orthoinj_early": dict(injection="orthoinj_early"),
    # learning-parity options: embedding scale, QK-norm, input norm, zero-init output projections
    "huginn_options": dict(injection="huginn_linear", embed_scale="sqrt_d", qk_norm=True, input_norm=True,
                           tie_embeddings=True, out_init_std=0.0, num_query_groups=2, sandwich_norm=True,
                           state_readout=True, qk_bias=True, adapter_init="normal", adapter_bias=False,
                           state_final_norm=True),
    "nonorm_options": dict(injection="parcae_nonorm", input_norm=True, qk_norm=True, embed_scale=2.5),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@torch.no_grad()
def perturb(model, scale: float = 0.05) -> None:
    from megaloop.runtime.parallel import stable_seed

    for name, p in model.named_parameters():
        p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(stable_seed("hf-test", name, 0))))


def build_native(overrides: dict, seed: int = 5):
    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig

    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, vocab_size=VOCAB, state_init_std=0.5, **overrides)
    chunks, _ = build_model(cfg, vocab_size=VOCAB, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=seed, ddp=False)
    return cfg, chunks


@pytest.fixture(scope="module")
def converted(megatron_world, tmp_path_factory):
    """Every variant: perturbed native model → checkpoint → HF folder; native eval logits kept."""
    from megaloop.config import RunConfig
    from megaloop.data.config import DataConfig
    from megaloop.hf.convert import convert_to_hf
    from megaloop.model.build import unwrap
    from megaloop.train.checkpoint import CheckpointManager

    root = tmp_path_factory.mktemp("hfconv")
    tok = bpe_tokenizer(root / "tok")
    dataset = root / "dataset"  # the run's data manifest points at the tokenizer
    dataset.mkdir()
    (dataset / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "tokenizer": {
        "path": str(tok), "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}}))  # as converters record it
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        cfg, chunks = build_native(overrides)
        perturb(chunks[0])
        native = chunks[0].eval()
        if cfg.bf16:  # reference: the bf16 weights in an FP32 native model
            _, ref_chunks = build_native({**overrides, "bf16": False})
            ref_chunks[0].load_state_dict(unwrap(chunks[0]).state_dict())
            native = ref_chunks[0].eval()
        with torch.no_grad():
            logits = native(ids, depth=5)
        run = RunConfig(model=cfg, data=DataConfig(path=str(dataset)))
        ckpt = CheckpointManager(root / name / "checkpoints").save(
            3, chunks, None, common={"step": 3, "tokens": 0, "config": run.to_dict()})
        hf_dir = root / name / "hf"
        # variant 0 goes through the run dir and an explicit --tokenizer, the rest through the manifest
        report = convert_to_hf(root / name if i == 0 else ckpt, hf_dir, tokenizer=tok if i == 0 else None,
                               log=lambda *_: None)
        torch.save(ids, hf_dir / "ids.pt")
        out[name] = {"ckpt": ckpt, "hf": hf_dir, "logits": logits, "report": report}
    return out


def test_conversion_validates_and_writes_folder(converted):
    for name, item in converted.items():
        rep = item["report"]
        assert rep["validation"]["error"] <= TOL, (name, rep["validation"])
        assert rep["reload"]["max_abs"] <= 1e-6
        hf = item["hf"]
        for f in ("config.json", "model.safetensors", "configuration_megaloop.py", "modeling_megaloop.py", "cache_megaloop.py",
                  "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (hf / f).is_file(), f"{name}: {f} missing"
        cfg = json.loads((hf / "config.json").read_text())
        assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_megaloop.MegaloopForCausalLM"
        assert cfg["model_type"] == "megaloop" and cfg["vocab_size"] == 256 and cfg["tokenizer_vocab_size"] == VOCAB
        gen = json.loads((hf / "generation_config.json").read_text())
        assert gen["eos_token_id"] == 0 and gen["suppress_tokens"] == list(range(VOCAB, 256))
    assert converted["parcae_decay"]["report"]["step"] == 3
    # sandwich norms (Huginn's blocks) travel as config + two gains per layer, and were validated above
    sandwich = converted["huginn_options"]["hf"]
    assert json.loads((sandwich / "config.json").read_text())["sandwich_norm"] is True
    from safetensors import safe_open

    with safe_open(str(sandwich / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {f"model.{g}.0.{n}.weight" for g in ("prelude", "core", "coda") for n in ("post_attn_norm", "post_mlp_norm")} <= keys
    assert "model.state_readout.weight" in keys  # readout C (Parcae's), validated above with the rest
    assert {f"model.core.1.self_attn.{n}_bias" for n in "qk"} <= keys  # Huginn's QK biases


def test_isolated_load_matches_native(converted, tmp_path):
    """Fresh `python -I` process, cwd outside the repo, no PYTHONPATH, megaloop/megatron blocked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = tmp_path / "result.pt"
    folders = [str(item["hf"]) for item in converted.values()]
    proc = subprocess.run([sys.executable, "-I", str(ROOT / "tests/hf/isolated_load.py"), str(result), *folders],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ISOLATED OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    got = torch.load(result)
    for name, item in converted.items():
        entry = got[str(item["hf"])]
        err = (entry["logits"] - item["logits"]).abs().max().item()
        assert err < TOL, f"{name}: isolated HF vs native max abs logit error {err:.2e}"
        assert entry["num_recurrences"] == 5 and entry["generate"].shape == (2, 12)
        assert entry["override"] == (8, "per_visit")
        assert entry["automodel"][0] == "MegaloopModel" and entry["automodel"][1] <= 1e-6, entry["automodel"]
        assert entry["eos"] == "<|endoftext|>" and len(entry["tokens"]) > 0
        assert entry["padding_side"] == "left" and entry["padded_batch_ok"], name  # plain `tok(..., padding=True)`


def test_tp2_and_pp2_checkpoints_convert(megatron_world, tmp_path):
    from megaloop.hf.convert import convert_to_hf
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    out = run_torchrun(ROOT / "tests/distributed/hf_tp2_ckpt_worker.py", 2, str(tmp_path))
    assert "CKPT OK" in out
    # TP=2: loads at TP=1 in this process, validates against it, and reproduces the TP=2 logits
    rep = convert_to_hf(tmp_path / "tp2", tmp_path / "hf_tp2", log=lambda *_: None)
    assert rep["validation"]["error"] <= TOL
    model = MegaloopForCausalLM.from_pretrained(tmp_path / "hf_tp2", dtype=torch.float32).eval()
    ids, ref = torch.load(tmp_path / "tp2/ids.pt"), torch.load(tmp_path / "tp2/logits.pt")
    with torch.no_grad():
        err = (model(ids, use_cache=False, num_recurrences=5).logits - ref).abs().max().item()
    assert err < TOL, f"TP=2 checkpoint: HF vs TP=2 native logits {err:.2e}"
    # PP=2: matches a TP=1/PP=1 native model with the same (name-seeded) weights
    rep = convert_to_hf(tmp_path / "pp2/checkpoints", tmp_path / "hf_pp2", log=lambda *_: None)
    assert rep["validation"]["error"] <= TOL
    cfg, chunks = build_native(dict(injection="huginn_linear", num_query_groups=2, qk_bias=True, state_readout=True,
                                    state_final_norm=True), seed=7)
    perturb(chunks[0])
    model = MegaloopForCausalLM.from_pretrained(tmp_path / "hf_pp2", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = chunks[0].eval()(ids, depth=5)
        err = (model(ids, use_cache=False).logits - ref).abs().max().item()
    assert err < TOL, f"PP=2 checkpoint: HF vs TP=1 native logits {err:.2e}"


def test_bad_inputs_give_clear_errors(megatron_world, converted, tmp_path):
    from megaloop.hf.convert import convert_to_hf
    from megaloop.train.checkpoint import CheckpointError

    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"checkpoint {missing} does not exist"):
        convert_to_hf(missing, tmp_path / "o1")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "weights.bin").write_text("x")
    with pytest.raises(CheckpointError, match=f"{junk} is not a megaloop checkpoint"):
        convert_to_hf(junk, tmp_path / "o2")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "common.pt").write_text("x")
    with pytest.raises(CheckpointError, match="incomplete: missing megaloop.json, .metadata"):
        convert_to_hf(partial, tmp_path / "o3")
    # the two directions swapped: each error says which command the folder needs
    from megaloop.hf.convert import ConversionError
    from megaloop.hf.from_hf import convert_from_hf

    item = next(iter(converted.values()))
    with pytest.raises(CheckpointError, match="it is a Hugging Face folder: `megaloop convert --from-hf"):
        convert_to_hf(item["hf"], tmp_path / "o4")
    with pytest.raises(ConversionError, match=r"it is a megaloop checkpoint: `megaloop convert --checkpoint .* "
                                              r"\(without --from-hf\)"):
        convert_from_hf(item["ckpt"], tmp_path / "o5")
    assert not (tmp_path / "o4").exists() and not (tmp_path / "o5").exists()


def test_wrong_architecture_is_reported(megatron_world, converted, tmp_path):
    """A checkpoint whose stored config says one architecture but whose tensors are another."""
    from megaloop.hf.convert import convert_to_hf
    from megaloop.train.checkpoint import CheckpointError

    src = converted["orthoinj"]["ckpt"]
    bad = tmp_path / "step_00000003"
    shutil.copytree(src, bad)
    common = torch.load(bad / "common.pt", weights_only=False)
    common["common"]["config"]["model"]["injection"] = "huginn_linear"
    torch.save(common, bad / "common.pt")
    with pytest.raises(CheckpointError, match=f"checkpoint {bad} does not match the model") as err:
        convert_to_hf(bad, tmp_path / "o4")
    assert "missing: injection.adapter.bias, injection.adapter.weight" in str(err.value)
    assert "unexpected: injection.alpha_log" in str(err.value)
    common["common"]["config"]["model"]["injection"] = "spiral"
    torch.save(common, bad / "common.pt")
    with pytest.raises(CheckpointError, match="model.injection"):
        convert_to_hf(bad, tmp_path / "o5")
    del common["common"]["config"]
    torch.save(common, bad / "common.pt")
    with pytest.raises(CheckpointError, match="no run config"):
        convert_to_hf(bad, tmp_path / "o6")


def test_cli_and_hf_roundtrip(megatron_world, converted, tmp_path):
    """tools/convert_to_hf.py (bf16, sharded, no validation) and HF → megaloop back."""
    from megaloop.hf.convert import load_native
    from megaloop.hf.from_hf import convert_from_hf
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    item = converted["deq_qkv"]
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import convert_to_hf as cli
    finally:
        sys.path.pop(0)
    assert cli.main(["--checkpoint", str(item["ckpt"]), "--out", str(tmp_path / "bf16"), "--dtype", "bf16",
                     "--no-validate", "--max-shard-size", "200KB"]) == 0
    assert (tmp_path / "bf16/model.safetensors.index.json").is_file()
    bf = MegaloopForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert bf.dtype == torch.bfloat16
    assert cli.main(["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    # an --out that holds something other than an earlier export, or a bad --depth: refused first
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    assert cli.main(["--checkpoint", str(item["ckpt"]), "--out", str(run_dir), "--no-validate"]) == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]
    assert cli.main(["--checkpoint", str(item["ckpt"]), "--out", str(tmp_path / "d0"), "--depth", "0"]) == 2
    assert not (tmp_path / "d0").exists()
    assert cli.main(["--checkpoint", str(item["ckpt"]), "--out", str(tmp_path / "bf16"), "--dtype", "bf16",
                     "--no-validate"]) == 0  # re-exporting over an earlier export is allowed
    # HF (fp32 folder) → megaloop checkpoint → native model: same logits as the original native model
    ckpt = convert_from_hf(item["hf"], tmp_path / "back")
    native, *_ = load_native(ckpt)
    ids = torch.load(item["hf"] / "ids.pt")
    with torch.no_grad():
        err = (native(ids, depth=5) - item["logits"]).abs().max().item()
    assert err < 1e-5, f"HF → megaloop round trip: {err:.2e}"
    # into RUN/checkpoints: the folder's tokenizer lands in RUN/ (found before the embedded default)
    # and its default depth becomes the run's eval depth
    from megaloop.hf.convert import find_tokenizer

    back = convert_from_hf(item["hf"], tmp_path / "run_back" / "checkpoints")
    _, _, run_cfg, _, _ = load_native(back)
    hf_cfg = json.loads((item["hf"] / "config.json").read_text())
    assert run_cfg["train"]["eval_depth"] == hf_cfg["num_recurrences"]
    tok = find_tokenizer(run_cfg, back)
    assert tok == tmp_path / "run_back" / "tokenizer.json"
    assert tok.read_bytes() == (item["hf"] / "tokenizer.json").read_bytes()


def _not_loaded(*_a, **_k):
    raise AssertionError("the checkpoint was loaded before the bad flag was refused")


def test_bad_max_shard_size_and_a_failed_export_leave_out_as_it_was(megatron_world, converted, tmp_path, monkeypatch,
                                                                    capsys):
    """--max-shard-size is parsed before loading (named, exit 2); the export is written beside --out
    and renamed into place, so a failure while writing leaves --out as it was (absent, or the earlier
    export, which a later re-export then replaces whole)."""
    import megaloop.hf.convert as convert
    from megaloop.hf.convert_cli import main, shard_size

    assert [shard_size(v) for v in ("2GB", "500mb", "0.5 GB", "1000")] == [2 * 10**9, 5 * 10**8, 5 * 10**8, 1000]
    ckpt, out = str(converted["deq_qkv"]["ckpt"]), tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(convert, "load_native", _not_loaded)
        assert main(["--checkpoint", ckpt, "--out", str(out), "--max-shard-size", "bogus"]) == 2
    assert "error: --max-shard-size 'bogus': not a size" in capsys.readouterr().err and not out.exists()
    assert main(["--checkpoint", ckpt, "--out", str(out), "--no-validate", "--max-shard-size", "200KB"]) == 0
    sharded = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "model.safetensors.index.json" in sharded

    def disk_full(*_a, **_k):
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(convert, "save_tokenizer", disk_full)  # fails after the weights were written
        for target in (out, tmp_path / "new"):
            with pytest.raises(OSError, match="No space left"):
                convert.convert_to_hf(ckpt, target, validate=False, log=lambda *_: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == sharded
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no half-written folder, no staging left
    convert.convert_to_hf(ckpt, out, validate=False, log=lambda *_: None)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert not any(p.name.startswith("model-0") for p in out.iterdir())


def test_a_tokenizer_that_is_not_a_tokenizer_json_is_refused(megatron_world, converted, tmp_path, monkeypatch,
                                                             capsys):
    import megaloop.hf.convert as convert
    from megaloop.hf.convert_cli import main

    yaml = tmp_path / "config.yaml"
    yaml.write_text("model: {}\n")
    out = tmp_path / "hf"
    monkeypatch.setattr(convert, "load_native", _not_loaded)
    assert main(["--checkpoint", str(converted["deq_qkv"]["ckpt"]), "--out", str(out), "--tokenizer", str(yaml)]) == 2
    assert f"error: --tokenizer {yaml}: not a tokenizer.json" in capsys.readouterr().err and not out.exists()


def test_from_hf_refuses_an_out_that_holds_checkpoints(megatron_world, converted, tmp_path):
    """A step 0 written among a run's checkpoints would become their `latest` (and its tokenizer
    would land in the run): refused, naming --out and its newest checkpoint; nothing written."""
    from megaloop.hf.convert import ConversionError
    from megaloop.hf.from_hf import convert_from_hf

    item = converted["deq_qkv"]
    run = tmp_path / "run"
    shutil.copytree(item["ckpt"].parent, run / "checkpoints")
    before = sorted(run.rglob("*"))
    for out in (run / "checkpoints", run):
        with pytest.raises(ConversionError, match=re.escape(f"--out {out} already holds megaloop checkpoints "
                                                            f"(newest: {run / 'checkpoints/step_00000003'})")):
            convert_from_hf(item["hf"], out)
    assert sorted(run.rglob("*")) == before and (run / "checkpoints/latest").read_text().strip() == "step_00000003"


def test_from_hf_names_a_config_json_that_is_not_json(megatron_world, converted, tmp_path, capsys):
    from megaloop.config_utils import ConfigError
    from megaloop.hf.from_hf import convert_from_hf
    from megaloop.hf.convert_cli import main

    hf = tmp_path / "hf"
    shutil.copytree(converted["deq_qkv"]["hf"], hf)
    (hf / "config.json").write_text('{"model_type": "megaloop",')  # truncated
    named = f"--checkpoint {hf}: {hf / 'config.json'} is not valid JSON"
    with pytest.raises(ConfigError, match="^" + re.escape(named)):
        convert_from_hf(hf, tmp_path / "back")
    assert main(["--from-hf", "--checkpoint", str(hf), "--out", str(tmp_path / "back")]) == 2
    assert f"error: {named}" in capsys.readouterr().err and not (tmp_path / "back").exists()


def test_from_hf_keeps_the_tokenizer_outside_a_checkpoints_folder(megatron_world, converted, tmp_path):
    """--out not named `checkpoints` (here an existing empty folder): the folder's tokenizer is kept
    in it, and loading the checkpoint uses it, not the embedded default."""
    from megaloop.data.tokenizer import file_sha256
    from megaloop.hf.from_hf import convert_from_hf
    from megaloop.inference.engine import InferenceEngine

    hf, root = converted["deq_qkv"]["hf"], tmp_path / "some" / "ckpts"
    root.mkdir(parents=True)
    assert convert_from_hf(hf, root) == root / "step_00000000"
    assert not (tmp_path / "some" / "tokenizer.json").exists()
    engine = InferenceEngine.load(root, validate=False)
    assert engine.source["tokenizer"] == str(root / "tokenizer.json")
    assert engine.tokenizer.sha256 == file_sha256(hf / "tokenizer.json")


def test_out_folders_that_would_mix_or_lose_outputs_are_refused(megatron_world, converted, tmp_path, capsys):
    """--from-hf into an HF export (or any non-empty folder, or the input itself); an export into a
    folder holding checkpoints (even next to an earlier export's marker); an --out under a file:
    one line each, exit 2, nothing written or removed."""
    from megaloop.hf.convert_cli import main

    item = converted["deq_qkv"]
    export = tmp_path / "export"
    shutil.copytree(item["hf"], export)
    mixed = tmp_path / "mixed"
    shutil.copytree(item["hf"], mixed)
    shutil.copytree(item["ckpt"], mixed / item["ckpt"].name)
    afile = tmp_path / "afile"
    afile.write_text("kept")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        (["--from-hf", "--checkpoint", str(item["hf"]), "--out", str(export)], f"--out {export} is not empty"),
        (["--from-hf", "--checkpoint", str(export), "--out", str(export)], "is the --checkpoint folder itself"),
        (["--checkpoint", str(item["ckpt"]), "--out", str(mixed)], f"--out {mixed} holds megaloop checkpoints"),
        (["--checkpoint", str(item["ckpt"]), "--out", str(afile / "sub")], f"{afile} is a file, not a folder"),
        (["--from-hf", "--checkpoint", str(export), "--out", str(afile / "ck")], f"{afile} is a file, not a folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("flags", [["--dtype", "bf16"], ["--no-validate"], ["--tokenizer", "t.json"], ["--depth", "3"],
                                   ["--max-shard-size", "1GB"]])
def test_from_hf_refuses_the_exports_options(tmp_path, capsys, flags):
    """Options of the export (megaloop -> HF) are refused with --from-hf, not silently ignored."""
    from megaloop.hf.convert_cli import main

    out = tmp_path / "back"
    assert main(["--from-hf", "--checkpoint", str(tmp_path / "hf"), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]}: applies to the export (megaloop -> HF); --from-hf takes only" in err and not out.exists()


def test_depth_on_an_untied_model_is_refused_before_loading(converted, tmp_path, capsys):
    """convert --depth N on an untied model wrote num_recurrences N and a 'depth N' validation line,
    where eval and generate refuse depth flags on it."""
    from megaloop.hf.convert_cli import main

    ckpt = converted["untied"]["ckpt"]
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), "--depth", "7"]) == 2
    err = capsys.readouterr().err
    assert "--depth: " in err and "untied (non-looped) model, it has no depth to vary" in err, err
    assert not (tmp_path / "o").exists()
