"""Loading a patched model: ``load_patched`` (a ``save_patched`` directory, the model built on the meta
device, int8 tensors read straight onto the device) against the way without it, transformers'
``from_pretrained`` of the float checkpoint followed by ``patch_model``; the same random-weight
Llama-shaped model, saved once to a temporary directory. Each load runs in a fresh child process
(nothing cached in it), twice, the faster kept; a row gives its wall seconds (imports excluded) and
the memory the load took, measured after a byte of every page of every weight was read (a CPU load
maps its files and reads a page only when it is touched): on the CPU the growth of the
process's peak resident set over what the imports left, on a GPU the peak CUDA allocation.

CPU: TinyLlama-1.1B's shapes in bfloat16 (2.2 GB of float weights). GPU: Llama-3.2-3B's in bfloat16
(6.4 GB; the int8 model is 3.6 GB with its float embeddings), loaded onto the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gptfast_kernels import patch_model, save_patched

CPU_CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
GPU_CONFIG = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=True)
REPEATS = 2

# the child: imports, then one load, timed; prints a JSON line
_CHILD = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
from gptfast_kernels import load_patched, patch_model
way, path, device = sys.argv[1:4]
cuda = device.startswith("cuda")
def status_bytes(field):  # the kernel's figure for this process, kB in /proc/self/status
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # (resets the peak resident set, VmHWM, to the current one)
rss_before = status_bytes("VmRSS")
start = time.perf_counter()
if way == "load_patched":
    model = load_patched(path, device=device)
else:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    patch_model(model)
if cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
# every page read in (a CPU load maps its files and reads a page only when it is touched): a byte of each
for tensor in [*model.parameters(), *model.buffers()]:
    if tensor.numel():
        tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum()
peak = torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM") - rss_before
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print("@@" + json.dumps({"seconds": seconds, "peak_bytes": peak, "model_bytes": held}))
"""


def _load_in_child(way: str, path: str, device: torch.device) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, way, path, str(device)], capture_output=True, text=True,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{way} failed in its child process: {done.stderr[-2000:]}")
    return json.loads(lines[-1][2:])


def run(h) -> None:
    sizes = GPU_CONFIG if h.device.type == "cuda" else CPU_CONFIG
    with tempfile.TemporaryDirectory() as root:
        float_dir, int8_dir = os.path.join(root, "float"), os.path.join(root, "int8")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**sizes)).to(torch.bfloat16).eval()
        model.save_pretrained(float_dir)
        float_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        save_patched(patch_model(model), int8_dir)
        del model
        case = {"model": f"llama hidden {sizes['hidden_size']} x {sizes['num_hidden_layers']} layers",
                "float_weight_bytes": float_bytes}
        results = {}
        for way, path in (("from_pretrained+patch_model", float_dir), ("load_patched", int8_dir)):
            runs = [_load_in_child(way, path, h.device) for _ in range(REPEATS)]
            results[way] = min(runs, key=lambda r: r["seconds"])
        base = results["from_pretrained+patch_model"]
        for way, result in results.items():
            h.rows.append({"op": "load", **case, "impl": way, "baseline": "from_pretrained+patch_model", **result,
                           "speedup_vs_baseline": base["seconds"] / result["seconds"],
                           "peak_vs_baseline": result["peak_bytes"] / base["peak_bytes"], **h.meta})
