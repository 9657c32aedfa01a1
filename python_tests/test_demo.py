"""``python -m gptfast_kernels demo`` in-process with tiny settings (a 2-second training budget,
8 new tokens), into a temp cache dir: the report's figures, the cache, and --model/--draft."""

import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
from gptfast_kernels.cli import main  # noqa: E402
from gptfast_kernels.demo.data import ByteTokenizer, code_prompts, load_corpus  # noqa: E402
from gptfast_kernels.demo.training import TrainSettings, build_model  # noqa: E402


def _demo(capsys, *args) -> str:
    # --threads: keep this process's torch thread count as it is
    code = main(["demo", "--threads", str(torch.get_num_threads()), "--device", "cpu", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def _check_report(out: str, prompts: int) -> None:
    for side in ("baseline: transformers generate", "optimized: int8 + fused attention",
                 "optimized + speculative (k=", "optimized + prompt lookup (k="):
        assert re.search(re.escape(side) + r".*\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out), (side, out)
    assert re.search(r"speed-up \(speculative vs baseline\): [\d.]+x", out), out
    assert re.search(r"acceptance rate: [\d.]+% \(\d+ of \d+ draft tokens\)", out), out
    assert f"speculative == optimized target's own greedy decoding: True ({prompts}/{prompts} prompts" in out, out
    assert re.search(r"prompt lookup acceptance rate: [\d.]+% \(\d+ of \d+ draft tokens\)", out), out
    assert f"prompt lookup == optimized target's own greedy decoding: True ({prompts}/{prompts} prompts" in out, out
    assert re.search(r"speculative == transformers generate, float32 baseline: (True|False)", out), out


def test_info_names_backends_and_families(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"usable on cpu\s+\[.*'cpu'.*'reference'", out), out
    assert "model families  llama, mistral, qwen2, qwen3, gemma" in out, out


def _warmup_seconds(out: str) -> dict[str, float]:
    line = next(line for line in out.splitlines() if line.strip().startswith("warm-up, untimed:"))
    return {name: float(seconds) for name, seconds in re.findall(r"(baseline|optimized[^,(]*?) ([\d.]+) s", line)}


def test_demo_trains_caches_and_reports(tmp_path, capsys):
    tiny = ["--train-seconds", "2", "--max-new-tokens", "8", "--num-prompts", "2", "--cache-dir", str(tmp_path),
            "--no-compile"]
    first = _demo(capsys, *tiny)
    _check_report(first, 2)
    assert "byte-level" in first and "standard library" in first and "trained now, saved to" in first
    assert "the optimized sides' decode steps eager" in first
    assert len(list(tmp_path.glob("byte-llama-*/target/config.json"))) == 1

    second = _demo(capsys, *tiny, "--no-progress", "--batch-size", "2", "--speculate-k", "2")
    _check_report(second, 2)
    assert "loaded from cache" in second and "trained now" not in second

    retrained = _demo(capsys, "--train-seconds", "1", *tiny[2:], "--no-progress")  # new settings: new entry
    assert "trained now" in retrained
    assert len(list(tmp_path.glob("byte-llama-*/training.json"))) == 2

    again = _demo(capsys, "--train-seconds", "1", *tiny[2:], "--no-progress", "--retrain")  # same settings
    assert "trained now" in again and "loaded from cache" not in again
    assert len(list(tmp_path.glob("byte-llama-*/training.json"))) == 2


def test_demo_prompts_batches_and_no_int8(tmp_path, capsys):
    out = _demo(capsys, "--train-seconds", "1", "--max-new-tokens", "6", "--cache-dir", str(tmp_path), "--no-progress",
                "--prompt", "import os\n", "--prompt", "    def __init__(self, name):\n        self.",
                "--num-prompts", "3", "--batch-size", "2", "--no-int8", "--no-compile")
    _check_report(out.replace("float32 + fused", "int8 + fused"), 3)
    assert "optimized: float32 + fused attention" in out


def test_demo_compiles_by_default(tmp_path, capsys):
    """The default runs the optimized sides' steps through torch.compile: their warm-up compiles them
    (batches of 2 and, for the third prompt, of 1: a graph each, all built before the timed runs),
    and the compiled speculative and prompt-lookup sides still reproduce the compiled target's own
    greedy tokens exactly (checked by _check_report)."""
    out = _demo(capsys, "--train-seconds", "1", "--max-new-tokens", "12", "--cache-dir", str(tmp_path), "--no-progress",
                "--num-prompts", "3", "--batch-size", "2")
    _check_report(out, 3)
    assert "the optimized sides' decode steps compiled (torch.compile)" in out, out
    warmup = _warmup_seconds(out)
    assert set(warmup) == {"baseline", "optimized", "optimized + speculative", "optimized + prompt lookup"}, out
    # compiling takes seconds; transformers' eager warm-up of two 12-token batches does not
    assert warmup["optimized"] > warmup["baseline"], out


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_demo_with_local_checkpoints(tmp_path, capsys, with_tokenizer):
    torch.manual_seed(0)
    target = build_model({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "num_key_value_heads": 1})
    draft = build_model({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 2})
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    if with_tokenizer:  # a word-level tokenizer over the same 259 ids
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = {f"w{i}": i for i in range(ByteTokenizer.vocab_size)}
        words.update({"<pad>": ByteTokenizer.PAD, "<eos>": ByteTokenizer.EOS, "<unk>": 0})
        del words[f"w{ByteTokenizer.PAD}"], words[f"w{ByteTokenizer.EOS}"], words["w0"]
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                unk_token="<unk>").save_pretrained(tmp_path / "target")
    out = _demo(capsys, "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                "--max-new-tokens", "8", "--num-prompts", "2", "--no-progress", "--no-compile", "--prompt", "w1 w2 w3",
                "--prompt", "w7")
    _check_report(out, 2)
    assert "local checkpoints" in out
    tokenizer_line = next(line for line in out.splitlines() if "tokenizer:" in line)
    assert ("byte-level" not in tokenizer_line) if with_tokenizer else ("byte-level" in tokenizer_line), out


def test_demo_names_a_checkpoint_it_cannot_load(tmp_path, capsys):
    """A missing checkpoint, or a directory without one, ends the demo with a message naming the
    option and the path (no traceback; nothing asked of a hub: neither is a hub name)."""
    target, empty = str(tmp_path / "target"), str(tmp_path / "empty")
    build_model({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2}).save_pretrained(target)
    (tmp_path / "empty").mkdir()
    for option, model, draft, bad in (("--model", "/nonexistent/target", target, "/nonexistent/target"),
                                      ("--draft", target, empty, empty)):
        with pytest.raises(SystemExit) as raised:
            main(["demo", "--model", model, "--draft", draft, "--no-progress"])
        message = str(raised.value.code)
        assert message.startswith(f"demo: {option} '{bad}' could not be loaded"), message


def test_demo_refuses_a_save_patched_directory_and_an_endless_training(tmp_path, capsys):
    """A directory save_patched wrote, as --model: from_pretrained found none of its int8 weights and
    the demo ran on random layers. --train-seconds inf passed the option check, then overflowed."""
    from gptfast_kernels import patch_model, save_patched

    model = build_model({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 2})
    model.save_pretrained(tmp_path / "float")
    save_patched(patch_model(model), tmp_path / "saved")
    for model_dir, draft_dir, option in ((tmp_path / "saved", tmp_path / "float", "--model"),
                                         (tmp_path / "float", tmp_path / "saved", "--draft")):
        with pytest.raises(SystemExit) as raised:
            main(["demo", "--model", str(model_dir), "--draft", str(draft_dir), "--no-progress"])
        assert str(raised.value.code).startswith(f"demo: {option} ") and "save_patched wrote" in str(
            raised.value.code)
    with pytest.raises(SystemExit):
        main(["demo", "--train-seconds", "inf", "--no-progress"])
    assert "--train-seconds: must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("model, outputs, noted", [(None, [[32] * 6, [10] * 6], True),
                                                    (None, [[32] * 6, [97, 98, 99]], False),
                                                    ("local", [[32] * 6, [10] * 6], False)])
def test_the_report_notes_a_degenerate_embedded_model(capsys, model, outputs, noted):
    """Embedded models trained too few steps (busy CPUs) continue every prompt with one repeated
    byte, and their acceptance rates are a degenerate model's: the report says so, and how to
    retrain (the cache keeps such weights). A local checkpoint's output is its own business."""
    import argparse
    import time

    from gptfast_kernels.demo.run import Side, _report

    sides = [Side(name, None, seconds=1.0, tokens=12, outputs=outputs, extra={"proposed": 8, "accepted": 8})
             for name in ("baseline: transformers generate, float32", "optimized: int8", "optimized + speculative",
                          "optimized + prompt lookup")]
    args = argparse.Namespace(compile=False, no_int8=False, model=model)
    assert _report(args, ["p1", "p2"], ByteTokenizer(), sides, 0.0, time.perf_counter()) == 0
    assert ("one character repeated" in capsys.readouterr().out) == noted


@pytest.mark.parametrize("device", ["banana", "mps", f"cuda:{torch.cuda.device_count()}"])
def test_demo_names_a_device_it_cannot_use(device):
    # (a string that is no device was a traceback from torch; before any training)
    with pytest.raises(SystemExit) as raised:
        main(["demo", "--device", device, "--no-progress"])
    assert str(raised.value.code).startswith("demo: --device") and device in str(raised.value.code)


def test_demo_needs_model_and_draft_together(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--model", "somewhere"])
    assert "--model and --draft go together" in capsys.readouterr().err


def test_demo_help_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "gptfast_kernels", "demo", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for option in ("--model", "--draft", "--batch-size", "--speculate-k", "--train-seconds", "--cache-dir",
                   "--device", "--seed", "--no-int8", "--max-new-tokens", "--prompt"):
        assert option in out


def test_byte_tokenizer_and_prompts():
    tokenizer = ByteTokenizer()
    ids, mask = tokenizer.batch(["ab", "héllo"])
    assert ids.shape == mask.shape == (2, 6) and ids[0, :4].tolist() == [ByteTokenizer.PAD] * 4
    assert tokenizer.decode(ids[1]) == "héllo" and tokenizer.decode([104, 0xC3]) == "h\ufffd"
    corpus = load_corpus()
    prompts = code_prompts(corpus, 3)
    assert len(prompts) == 3 and all("def " in p for p in prompts) and prompts == code_prompts(corpus, 3)
    assert TrainSettings(corpus="a").key() != TrainSettings(corpus="a", seconds=30).key()


def _proc_stat(*cpus) -> str:
    """/proc/stat's text with per-CPU lines of (busy, idle) ticks (busy as user time)."""
    lines = [f"cpu  {sum(b for b, _ in cpus)} 0 0 {sum(i for _, i in cpus)} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 0 0 0 0 0 0" for n, (busy, idle) in enumerate(cpus)]
    return "\n".join(lines + ["intr 12345", "ctxt 678"])


def test_busy_cpus_are_measured_now_on_the_cpus_this_process_may_use(monkeypatch):
    from gptfast_kernels.demo import run

    monkeypatch.setattr(run, "_usable_cpus", lambda: {0, 1})
    # 100 ticks each: CPU 0 busy for all of them, CPU 1 for 30; CPU 2 (not ours) busy throughout
    readings = iter([_proc_stat((1000, 1000), (500, 500), (0, 0)), _proc_stat((1100, 1000), (530, 570), (100, 0))])
    assert run._busy_cpus(lambda: next(readings), interval=0) == pytest.approx(2 * 130 / 200)

    def unreadable():
        raise OSError("no /proc/stat here")

    assert run._busy_cpus(unreadable, interval=0) is None


@pytest.mark.parametrize("busy, loadavg, expected", [(1.9, 0.0, 1), (0.3, 2.0, 2), (None, 2.0, 1), (None, 0.2, 2)])
def test_demo_threads_leave_out_the_cores_busy_now(monkeypatch, busy, loadavg, expected):
    """The load average counts what ran in the last minutes (set-up's compile just before the demo):
    it decides only where /proc/stat cannot be read."""
    from gptfast_kernels.demo import run

    monkeypatch.setattr(run, "_usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(run, "_busy_cpus", lambda: busy)
    monkeypatch.setattr(run.os, "getloadavg", lambda: (loadavg, loadavg, loadavg))
    monkeypatch.setattr(run.torch, "get_num_threads", lambda: 2)
    assert run._choose_threads(None) == expected
    assert run._choose_threads(3) == 3
