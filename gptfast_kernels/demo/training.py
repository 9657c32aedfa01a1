"""The demo's embedded default models: a small byte-level Llama target and a smaller draft, built
from configs and trained for about a minute on the standard library's sources, then cached.

Random-weight models would agree on almost no token, so speculation would look useless; trained
ones behave like a real target / draft pair. A minute of CPU training leaves the target unsure of
many bytes, and two separately trained small models then disagree on its near-ties, so:

1. (most of the budget) the target learns the next byte (cross-entropy) while its first layer's
   output, read through the final norm and head, learns the target's own next-byte distribution
   (KL): an early-exit draft, as in self-speculative decoding (Zhang et al. 2023) and LayerSkip
   (Elhoushi et al. 2024);
2. (the rest) that prefix is cut out as a model of its own (embeddings, first layer, norm, head)
   and distilled alone on the target's greedy continuations of corpus snippets, the text it will
   be asked to predict when decoding (on-policy distillation, as in DistillSpec, Zhou et al. 2023).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from gptfast_kernels.demo.data import ByteTokenizer, Corpus

CACHE_FORMAT = 1  # bump when the training recipe changes in a way the settings below do not show


def _llama(layers: int, hidden: int, heads: int) -> dict:
    return {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": 1024,
            "tie_word_embeddings": True}


@dataclass(frozen=True)
class TrainSettings:
    """Everything the trained weights depend on (the cache key)."""
    target: dict = field(default_factory=lambda: _llama(layers=4, hidden=256, heads=4))
    draft_layers: int = 1       # the draft is the target's first draft_layers layers (+ embeddings, norm, head)
    seconds: float = 60.0       # wall-clock training budget, both phases
    draft_share: float = 0.25   # the part of it spent on phase 2 (the draft alone)
    max_steps: int = 2000       # ends phase 1 earlier on a fast machine (a GPU)
    max_draft_steps: int = 300  # likewise for phase 2
    seq_len: int = 64           # bytes per training sequence
    batch_size: int = 8
    lr: float = 4e-3            # phase 1 peak AdamW learning rate (20 warm-up steps, cosine to 10 %)
    draft_lr: float = 1e-3      # phase 2 peak learning rate
    context: int = 32           # phase 2: bytes of corpus the target continues, and how many it adds
    seed: int = 0
    corpus: str = ""            # Corpus.fingerprint

    @property
    def draft(self) -> dict:
        return {**self.target, "num_hidden_layers": self.draft_layers}

    def key(self) -> str:
        blob = json.dumps({"format": CACHE_FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_model(config: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = ByteTokenizer
    llama = LlamaConfig(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.PAD, bos_token_id=tokenizer.BOS,
                        eos_token_id=tokenizer.EOS, **config)
    model = LlamaForCausalLM(llama)
    model.generation_config.pad_token_id = tokenizer.PAD
    model.generation_config.eos_token_id = tokenizer.EOS
    return model


def _learning_rate(peak: float, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / 20)
    return peak * warmup * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class _Phase:
    """A time- and step-bounded loop with a progress bar: ``for step, progress in phase``."""

    def __init__(self, name: str, seconds: float, max_steps: int, progress_bar: bool):
        from tqdm.auto import tqdm

        self.seconds, self.max_steps, self.steps, self.elapsed = seconds, max_steps, 0, 0.0
        self.bar = tqdm(total=max(1, int(round(seconds))), unit="s", desc=name, disable=not progress_bar,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total_fmt} s{postfix}")

    def __iter__(self):
        start = time.perf_counter()
        while True:
            self.elapsed = time.perf_counter() - start
            self.bar.update(min(self.bar.total, self.elapsed) - self.bar.n)
            progress = max(self.elapsed / self.seconds, self.steps / self.max_steps)
            if progress >= 1.0:
                break
            yield self.steps, progress
            self.steps += 1
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()

    def show(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Mean per-position KL(reference || logits) over [B, T, V] logits."""
    return F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(reference.float(), -1), log_target=True,
                    reduction="sum") / (logits.shape[0] * logits.shape[1])


def train(settings: TrainSettings, corpus: Corpus, device: torch.device, progress_bar: bool = True):
    """Builds and trains the target, cuts the draft out of it and distils it; returns
    (target, draft, stats)."""
    torch.manual_seed(settings.seed)
    target = build_model(settings.target).to(device).train()
    optimizer = torch.optim.AdamW(target.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(settings.seed)
    data, T, exit_layer = corpus.train, settings.seq_len, settings.draft_layers

    def snippets(length: int) -> torch.Tensor:
        starts = torch.randint(0, len(data) - length, (settings.batch_size,), generator=generator)
        return data[starts[:, None] + torch.arange(length)].to(device=device, dtype=torch.int64)

    # phase 1: the target, and its first layer as an early exit
    phase1 = _Phase("training target + early exit", settings.seconds * (1 - settings.draft_share), settings.max_steps,
                    progress_bar)
    smooth = {}  # moving averages of the losses, for display and the stats

    def average(name: str, value: torch.Tensor) -> float:
        smooth[name] = value.item() if name not in smooth else 0.9 * smooth[name] + 0.1 * value.item()
        return smooth[name]

    for step, progress in phase1:
        batch = snippets(T + 1)
        _set_lr(optimizer, _learning_rate(settings.lr, step, progress))
        out = target(batch[:, :-1], output_hidden_states=True)
        target_loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        exit_kl = _kl(target.lm_head(target.model.norm(out.hidden_states[exit_layer])), out.logits.detach())
        (target_loss + exit_kl).backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, kl = average("target_loss", target_loss), average("exit_kl", exit_kl)
        if step % 10 == 0:
            phase1.show(f"step {step}, target loss {loss:.2f}, exit KL {kl:.2f}")
    target.eval().requires_grad_(False)

    # phase 2: the draft alone, on the target's own greedy continuations
    draft = build_model(settings.draft).to(device)
    draft.load_state_dict({name: tensor for name, tensor in target.state_dict().items()
                           if not name.startswith("model.layers.") or int(name.split(".")[2]) < exit_layer})
    draft.train()
    draft_optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.draft_lr, betas=(0.9, 0.95))
    phase2 = _Phase("distilling the draft", settings.seconds * settings.draft_share, settings.max_draft_steps,
                    progress_bar)
    C = settings.context
    for step, progress in phase2:
        with torch.no_grad():
            text = target.generate(snippets(C), max_new_tokens=C, do_sample=False, pad_token_id=ByteTokenizer.PAD,
                                   eos_token_id=None)
            reference = target(text[:, :-1]).logits[:, C - 1:]
        _set_lr(draft_optimizer, _learning_rate(settings.draft_lr, step, progress))
        draft_kl = _kl(draft(text[:, :-1]).logits[:, C - 1:], reference)
        draft_kl.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        draft_optimizer.step()
        draft_optimizer.zero_grad(set_to_none=True)
        kl = average("draft_kl", draft_kl)
        if step % 5 == 0:
            phase2.show(f"step {step}, draft KL {kl:.2f}")
    draft.eval().requires_grad_(False)
    target.requires_grad_(True)
    stats = {"steps": phase1.steps, "seconds": round(phase1.elapsed, 1),
             "tokens": phase1.steps * settings.batch_size * T,
             **{name: round(value, 3) for name, value in smooth.items()},
             "draft_steps": phase2.steps, "draft_seconds": round(phase2.elapsed, 1),
             "device": str(device), "threads": torch.get_num_threads()}
    return target, draft, stats


def default_cache_dir() -> str:
    """``.demo_cache/`` at the repository root in a writable source checkout, else
    ``$XDG_CACHE_HOME/gptfast_kernels/demo`` (default ``~/.cache/...``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.exists(os.path.join(root, "setup.py")) and os.access(root, os.W_OK):
        return os.path.join(root, ".demo_cache")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gptfast_kernels", "demo")


def load_or_train(settings: TrainSettings, corpus: Corpus, cache_dir: str, device: torch.device,
                  progress_bar: bool = True, retrain: bool = False):
    """(target, draft, info): from ``cache_dir/<key>/`` when there (and not ``retrain``), else
    trained and saved there. info has the training stats and ``cached`` (bool) and ``path``."""
    from transformers import LlamaForCausalLM

    path = os.path.join(cache_dir, f"byte-llama-{settings.key()}")
    if retrain and os.path.isdir(path):
        shutil.rmtree(path)
    meta_path = os.path.join(path, "training.json")
    if os.path.exists(meta_path):
        with open(meta_path) as handle:
            info = json.load(handle)
        target = LlamaForCausalLM.from_pretrained(os.path.join(path, "target")).to(device).eval()
        draft = LlamaForCausalLM.from_pretrained(os.path.join(path, "draft")).to(device).eval()
        return target, draft, {**info, "cached": True, "path": path}
    target, draft, stats = train(settings, corpus, device, progress_bar)
    info = {"settings": asdict(settings), "stats": stats, "corpus": corpus.description}
    try:
        _save(target, draft, info, cache_dir, path)
    except OSError as error:  # the models are trained: go on without caching them
        warnings.warn(f"demo: could not cache the trained models in {cache_dir} ({error}); use --cache-dir",
                      stacklevel=2)
        return target, draft, {**info, "cached": False, "path": "(not saved)"}
    return target, draft, {**info, "cached": False, "path": path}


def _save(target, draft, info: dict, cache_dir: str, path: str) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=cache_dir)  # a half-written entry is never seen
    try:
        target.save_pretrained(os.path.join(staging, "target"))
        draft.save_pretrained(os.path.join(staging, "draft"))
        with open(os.path.join(staging, "training.json"), "w") as handle:
            json.dump(info, handle, indent=2)
        os.replace(staging, path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.exists(os.path.join(path, "training.json")):  # else another process won the race
            raise
