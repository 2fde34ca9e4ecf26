"""Adapters for the public reference implementations used by ``tools/bench/parity.py``.

The references are *not* part of megaloop: the user passes the path of a checkout (or an extracted
archive) of each repository, and this module imports its training model from there:

- Huginn (``seal-rg/recurrent-pretraining``): ``recpre.model_dynamic.RecurrentGPT`` built from the
  registry config ``nebel-raven-3.5b`` (huginn-0125's architecture: sandwich blocks, takase init,
  embedding scale √d, tied embeddings, bias-free linear adapter at the init std, ``like-init``
  state, per-head QK biases) with the shape
  overridden. ``recpre/__init__`` and ``recpre/utils`` import lightning (not installable here): the
  package is entered through a stub ``recpre`` package whose ``utils`` provides only
  ``find_multiple``; ``triton`` is replaced by an inert stand-in (never called with
  ``attn_impl=sdpa`` on CPU); ``recpre.checkpoint_patch`` needs a torch-internal name absent from
  torch 2.13, which is stubbed (activation checkpointing stays off). Depth: its own
  ``poisson-lognormal-filling`` sampler (one draw per step, ``model.step`` seeds it).
- Parcae (``sandyresearch/parcae``): ``parcae_lm.models.parcae.Parcae`` from the registry config
  ``parcae-small-140m`` (pre-norm blocks, QK-norm, ``scaled-zero`` orthogonal init, tied embeddings,
  prelude RMSNorm, diagonal injection, learned readout C initialised like its other weights, i.e. a
  random orthogonal matrix at std √(2/5d), not the identity, ``like-init`` state) with the
  shape overridden, **SwiGLU** (``GatedMLP``/SiLU) instead of its ReLU² MLP and **value embeddings
  off**, so that its FLOPs and parameters match megaloop's. Depth: its own ``poisson-truncated-full``
  sampler, one draw per sequence.

Each adapter exposes ``train_loss(tokens, labels, mask, step)`` (mean CE over unmasked targets at
the reference's own sampled depth), ``logits(tokens, depth)`` and ``trace(tokens, depth)`` (the
per-recurrence states and injection parts that :mod:`megaloop.eval.states` turns into diagnostics).
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Shape:
    """The matched model shape (megaloop's ``tiny`` preset by default)."""

    hidden: int = 128
    heads: int = 4
    ffn: int = 384
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    vocab: int = 4096
    seq_len: int = 128
    mean_depth: int = 5
    bptt_window: int = 4

    @classmethod
    def of(cls, m, vocab: int, *, mean_depth: int, bptt_window: int) -> "Shape":
        """The shape of megaloop model config ``m`` (a ``ModelConfig``) with ``vocab`` rows."""
        return cls(hidden=m.hidden_size, heads=m.num_heads, ffn=m.ffn_size, n_prelude=m.n_prelude, n_core=m.n_core,
                   n_coda=m.n_coda, vocab=vocab, seq_len=m.seq_len, mean_depth=mean_depth, bptt_window=bptt_window)


class _Any:
    """Inert value: attributes, calls, items and arithmetic give another one; comparisons and truth
    are False; a call with a single callable argument returns it (decorators leave functions alone)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Any()

    def __getitem__(self, key):
        return _Any()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    __index__ = __int__
    __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: False
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __floordiv__ = \
        __mod__ = __pow__ = lambda self, other: _Any()


class _Inert(types.ModuleType):
    """Stand-in for ``triton``/``triton.language`` (see :class:`_Any`)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


def _stub_triton() -> None:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return  # the real package, or the stand-in an earlier reference installed
    import torch._dynamo  # noqa: F401  (probes for triton on import: let it find none, not the stand-in)
    triton = _Inert("triton")
    lang = _Inert("triton.language")
    triton.language = lang
    sys.modules.setdefault("triton", triton)
    sys.modules.setdefault("triton.language", lang)


def _commit(root: Path) -> str:
    """The checkout's commit (git's answer: packed refs, worktrees and submodules included; reading
    ``.git/HEAD`` by hand recorded a ref name after ``git gc``), else a ``COMMIT`` file's, else unknown.
    A folder that is not itself a repository's top level (a copy inside another checkout) is not
    given the enclosing repository's commit."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=30)
        lines = top.stdout.splitlines()  # a path may hold spaces
        if top.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            return lines[1]
    except (OSError, subprocess.SubprocessError):  # no git here
        pass
    marker = root / "COMMIT"
    return marker.read_text().strip() if marker.exists() else "unknown"


def _masked_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE sum over unmasked targets, their count). logits [b, s, V], labels/mask [b, s]."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(mask)
    m = mask.float()
    return (ce * m).sum(), m.sum()


class Reference:
    name = "reference"

    def __init__(self, root: Path, shape: Shape, seed: int):
        self.root, self.shape, self.seed = root, shape, seed
        self.commit = _commit(root)

    def parameters(self):
        return self.model.parameters()

    def no_decay(self, name: str, p: torch.Tensor) -> bool:
        """The reference's own weight-decay exclusions: 1-D tensors and flagged parameters."""
        return p.ndim < 2 or getattr(p, "_no_weight_decay", False)

    def train_loss(self, tokens, labels, mask, step: int) -> tuple[torch.Tensor, float]:
        """Mean CE over unmasked targets at the reference's own depth draw; returns (loss, mean depth)."""
        self.model.train()
        self.model.step = step
        out = self.model(tokens, labels=None, return_logits=True)
        s, n = _masked_ce(out["logits"], labels, mask)
        return s / n.clamp_min(1), self.last_depth()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        self.model.eval()
        return self.model(tokens, return_logits=True, num_steps_pair=torch.tensor([depth]))["logits"]


class Huginn(Reference):
    name = "huginn"

    def __init__(self, root: Path, shape: Shape, seed: int):
        super().__init__(root, shape, seed)
        _stub_triton()
        pkg = types.ModuleType("recpre")
        pkg.__path__ = [str(root / "recpre")]
        sys.modules["recpre"] = pkg
        utils = types.ModuleType("recpre.utils")
        utils.find_multiple = lambda n, k: n if n % k == 0 else n + k - (n % k)
        sys.modules["recpre.utils"] = utils
        import torch.utils.checkpoint as ckpt

        if not hasattr(ckpt, "_NoopSaveInputs"):
            ckpt._NoopSaveInputs = type("_NoopSaveInputs", (torch.autograd.Function,), {})
        cfgmod = importlib.import_module("recpre.config_dynamic")
        importlib.import_module("recpre.model_dynamic")
        sh = shape
        cfg = cfgmod.RecurrentConfig.from_name(
            "nebel-raven-3.5b", n_embd=sh.hidden, num_attention_heads=sh.heads, num_key_value_heads=sh.heads,
            intermediate_size=sh.ffn, n_layers_in_prelude=sh.n_prelude, n_layers_in_recurrent_block=sh.n_core,
            n_layers_in_coda=sh.n_coda, mean_recurrence=sh.mean_depth, mean_backprop_depth=sh.bptt_window,
            vocab_size=sh.vocab, padding_multiple=128, block_size=sh.seq_len, attn_impl="sdpa",
            use_fused_head=False, activation_checkpoint_impl="none")
        torch.manual_seed(seed)
        self.model = cfg.construct_model(objective={"ignore_index": -100, "z_regularization": 0.0},
                                         gradient_checkpointing=False)
        self.cfg = cfg
        self._depth = 0
        orig = self.model.iterate_forward

        def iterate(*a, **k):
            out = orig(*a, **k)
            self._depth = int(out[1]) + int(out[2])
            return out

        self.model.iterate_forward = iterate

    def last_depth(self) -> float:
        return float(self._depth)

    def _encode(self, tokens: torch.Tensor):
        """(model in eval mode, its transformer, RoPE table, prelude output e [b, s, d])."""
        m = self.model.eval()
        t = m.transformer
        freqs = m.freqs_cis[:, : tokens.shape[1]]
        e = t.wte(tokens) * m.emb_scale if m.emb_scale != 1 else t.wte(tokens)
        for block in t.prelude:
            e = block(e, freqs, None)
        return m, t, freqs, e

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, depth: int, state_norm: bool = True) -> torch.Tensor:
        """Huginn's forward at ``depth``. Its ``iterate_forward`` applies ``ln_f`` to the final state
        before the coda as well as after it (one shared weight); ``state_norm=False`` runs the same
        computation without that first ``ln_f`` (what a model without it, such as megaloop's
        ``huginn_matched``, computes)."""
        if state_norm:
            return super().logits(tokens, depth)
        m, t, freqs, e = self._encode(tokens)
        x = m.initialize_state(e)
        for step in range(depth):
            x = m.core_block_forward(x, e, freqs, None, step)
        for block in t.coda:
            x = block(x, freqs, None)
        return m.lm_head(t.ln_f(x)).float() * self.cfg.init.logit_scale

    @torch.no_grad()
    def trace(self, tokens: torch.Tensor, depth: int) -> dict:
        """States h^0..h^R [b, s, d] as the coda sees them (Huginn's ln_f is applied to the final
        state only; the per-step state is the raw block output), the injected input e and, per
        recurrence, the adapter's state part W_h h and input part W_e e + bias."""
        m, t, freqs, e = self._encode(tokens)
        h = m.initialize_state(e)
        states, parts = [h], []
        d = h.shape[-1]
        w = t.adapter.weight
        b = t.adapter.bias if t.adapter.bias is not None else 0.0
        for step in range(depth):
            state_part = h @ w[:, :d].T
            input_part = e @ w[:, d:].T + b
            parts.append((state_part, input_part))
            h = m.core_block_forward(h, e, freqs, None, step)
            states.append(h)
        return {"e": e, "states": states, "parts": parts}


class Parcae(Reference):
    name = "parcae"

    def __init__(self, root: Path, shape: Shape, seed: int):
        super().__init__(root, shape, seed)
        _stub_triton()
        sys.path.insert(0, str(root))
        cfgmod = importlib.import_module("parcae_lm.models.parcae.config")
        modmod = importlib.import_module("parcae_lm.models.parcae.parcae")
        sh = shape
        cfg = cfgmod.ParcaeConfig.from_name(
            "parcae-small-140m", n_embd=sh.hidden, num_attention_heads=sh.heads, num_key_value_heads=sh.heads,
            intermediate_size=sh.ffn, recurrent_embedding_dimension=sh.hidden,
            recurrent_intermediation_embedding_dimension=sh.ffn, n_layers_in_prelude=sh.n_prelude,
            n_layers_in_recurrent_block=sh.n_core, n_layers_in_coda=sh.n_coda, mean_recurrence=sh.mean_depth,
            mean_backprop_depth=sh.bptt_window, vocab_size=sh.vocab, padding_multiple=128, block_size=sh.seq_len,
            mlp_class_name="GatedMLP", nonlin_name="SiLU", use_fused_head=False, attn_impl="sdpa",
            activation_checkpoint_impl="none")
        torch.manual_seed(seed)
        self.model = modmod.Parcae(cfg, objective={"ignore_index": -100, "z_regularization": 0.0})
        self.model.value_embeds = torch.nn.ModuleDict()  # value embeddings off (FLOP/parameter match)
        self.cfg = cfg
        self._depth = 0.0
        orig = self.model._sample_batch_depths

        def sample(*a, **k):
            n, kk = orig(*a, **k)
            self._depth = float((n + kk).float().mean())
            return n, kk

        self.model._sample_batch_depths = sample

    def last_depth(self) -> float:
        return self._depth

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        self.model.eval()
        pair = (torch.tensor(depth), torch.tensor(0))
        return self.model(tokens, return_logits=True, num_steps_pair=pair)["logits"]

    @torch.no_grad()
    def trace(self, tokens: torch.Tensor, depth: int) -> dict:
        m = self.model.eval()
        t = m.transformer
        freqs = m.freqs_cis[:, : tokens.shape[1]]
        m._current_input_ids = tokens
        e = t.wte(tokens) * m.emb_scale if m.emb_scale != 1 else t.wte(tokens)
        for block in t.prelude:
            e = block(e, freqs, None)
        if m.config.prelude_norm:
            e = t.ln_prelude(e)
        h = m.initialize_state(e)
        states, parts = [h], []
        zero = torch.zeros_like(h)
        total = torch.tensor(depth)
        for step in range(depth):
            q = t.adapter(zero, e)
            parts.append((t.adapter(h, e) - q, q))
            h = m.update_recurrent_state(h, e, freqs, None, torch.tensor(step), total)
            states.append(h)
        return {"e": e, "states": states, "parts": parts}


REFERENCES = {"huginn": Huginn, "parcae": Parcae}
TESTED_COMMITS = {"huginn": "59e0b69b", "parcae": "dee8363b"}  # the checkouts the README's results come from


def reference_root(name: str, path: str | Path) -> Path:
    """The checkout root of reference ``name`` at ``path``; a path without its model file is refused."""
    root = Path(path).expanduser().resolve()
    marker = {"huginn": "recpre/model_dynamic.py", "parcae": "parcae_lm/models/parcae/parcae.py"}[name]
    if not (root / marker).is_file():
        raise SystemExit(f"--ref-path: {root} has no {marker} (pass the root of a checkout of the {name} "
                         "repository)")
    return root


def load_reference(name: str, path: str | Path, shape: Shape, seed: int) -> Reference:
    """Import reference ``name`` from the checkout at ``path`` (errors name the path)."""
    root = reference_root(name, path)
    try:
        ref = REFERENCES[name](root, shape, seed)
    except ImportError as err:  # a checkout missing files, or a package the reference needs
        raise SystemExit(f"--ref-path: {root}: the {name} reference cannot be imported ({type(err).__name__}: "
                         f"{err}); pass a complete checkout and install what it imports") from None
    except (AttributeError, KeyError, TypeError, ValueError) as err:  # another revision's config registry or API
        raise SystemExit(f"--ref-path: {root}: the {name} reference cannot be configured as the harness does "
                         f"({type(err).__name__}: {err}); pass a checkout at commit {TESTED_COMMITS[name]}, the "
                         "one the harness was written against") from None
    tested = TESTED_COMMITS[name]
    short = len(ref.commit) >= 7 and tested.startswith(ref.commit)  # a COMMIT file with a 7-character hash
    if ref.commit != "unknown" and not (ref.commit.startswith(tested) or short):  # it was accepted without a word
        print(f"warning: {root} is at commit {ref.commit[:12]}; the README's {name} results come from {tested} "
              "(the harness was written against it): a difference from them may be the revision's", file=sys.stderr)
    elif ref.commit == "unknown":
        print(f"note: {root}: its commit is unknown (no git repository, no COMMIT file); the result records "
              f"'unknown' (the README's results come from {tested})", file=sys.stderr)
    return ref


def wsd_lr(step: int, peak: float, total: int, warmup: int, decay_fraction: float) -> float:
    """LR of update ``step`` (1-based), the same WSD shape megaloop's scheduler gives: linear warm-up
    from 0, constant peak, linear decay to 0 over the last ``decay_fraction`` of the horizon."""
    if warmup and step <= warmup:
        return peak * step / warmup
    decay = max(1, round(decay_fraction * total)) if decay_fraction > 0 else 0
    start = total - decay
    if decay and step > start:
        return peak * max(0.0, (total - step) / decay)
    return peak


def make_optimizer(ref: Reference, no_decay=None) -> torch.optim.AdamW:
    """The protocol's AdamW (β 0.9/0.95, ε 1e-8, wd 0.1) over ``ref``'s parameters; the ones for which
    ``no_decay(name, p)`` (default: the reference's own list) holds get no weight decay."""
    no_decay = no_decay or ref.no_decay
    decay, skip = [], []
    for name, p in ref.model.named_parameters():
        (skip if no_decay(name, p) else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": skip, "weight_decay": 0.0}],
                             lr=0.0, betas=(0.9, 0.95), eps=1e-8)


def train_step(ref: Reference, opt: torch.optim.Optimizer, batches: list[dict], step: int,
               lr: float) -> tuple[float, float, float]:
    """One update of ``ref`` on the concatenated microbatches at ``lr`` (gradient clipping at 1).
    Returns (loss, the depth it ran, gradient norm before clipping)."""
    tokens, labels, mask = (torch.cat([b[k] for b in batches]) for k in ("tokens", "labels", "loss_mask"))
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss, depth = ref.train_loss(tokens, labels, mask, step)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1.0))
    opt.step()
    return float(loss), depth, norm
