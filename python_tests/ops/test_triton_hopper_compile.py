"""Every Triton kernel compiled for an H100 (sm_90) on a machine without a GPU, at the launch
configurations its wrapper chooses on a GPU: in a child process with the interpreter off, the
wrappers run with their GPU tuning on CPU tensors of Llama-3-8B shapes, each launch is captured
instead of run, and Triton's own compiler (down to ptxas) builds it for sm_90. This proves what
the interpreter never exercises: tl.dot shapes and dtypes, layouts, and shared memory within the
227 KiB an H100 block may use. Each kernel's registers and stack frame (spills) are read from its
cubin by cuobjdump; run with -s to see them. (With a GPU present the GPU tests run these kernels for
real.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from bench.read_floor import BLOCKS as READ_FLOOR_BLOCKS
from gptfast_kernels import _extension

SM90 = 90
H100_MAX_SHARED_BYTES = 227 * 1024
H100_SMS = 132
_MARK = "@@compiled "
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
          torch.int32: "i32", torch.int64: "i64"}


# -- the launches: each case calls one wrapper as a GPU run would --------------------------------

def _int8_linear(dtype, M):
    from gptfast_kernels.triton.int8_linear import int8_linear_triton

    N, K = 4096, 4096
    int8_linear_triton(torch.zeros(M, K, dtype=dtype), torch.zeros(N, K, dtype=torch.int8), torch.ones(N),
                       torch.zeros(N, dtype=dtype))


# Multi-head latent attention as multi-query attention: 16 query heads over one kv head of 576.
MLA_HEADS = (16, 1)


def _kv_cache_attention(dtype, T, D, S, window=0, heads=(32, 8), value_dim=0, chunk_size=0, ring=False,
                        alibi=False):
    """window > 0: a ring buffer of S slots (ring=True) at positions past S, as a sliding layer's.
    heads: (query heads, kv heads). value_dim > 0: values in the keys (v and v_cache empty).
    chunk_size > 0: chunked attention (its own kernels: the chunk size is a constexpr); with ``ring``
    in a ring buffer of S slots, as a Llama 4 chunked layer's. alibi: ALiBi slopes (HAS_ALIBI)."""
    from gptfast_kernels.triton.kv_cache_attention import kv_cache_attention_triton

    B, (Hq, Hkv) = 1, heads
    ring = ring or window > 0
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    positions = torch.arange(T).expand(B, T).contiguous() + (3 * S if ring else 0)
    v, v_cache = (zeros(0), zeros(0)) if value_dim else (zeros(B, Hkv, T, D), zeros(B, Hkv, S, D))
    kv_cache_attention_triton(zeros(B, Hq, T, D), zeros(B, Hkv, T, D), v, zeros(B, Hkv, S, D), v_cache, positions,
                              D ** -0.5, window, 0.0, None, ring, value_dim, chunk_size,
                              torch.ones(Hq) if alibi else None)


def _kv_cache_attention_programmatic(dtype, T):
    """Llama-3-8B heads at a 4k cache, the decode kernels as programmatic dependent launches
    (GPTFAST_CUDA_PDL=1: griddepcontrol in both, launch_pdl)."""
    import gptfast_kernels.triton.kv_cache_attention as kv

    original = kv.programmatic_launch
    kv.programmatic_launch = lambda device: True
    try:
        _kv_cache_attention(dtype, T, 128, 4096)
    finally:
        kv.programmatic_launch = original


def _kv_cache_attention_fused_combine(dtype, T, D, S, heads=(32, 8), value_dim=0, programmatic=False):
    """The decode kernel with the fused combine (Tuning.fused_combine): no combine kernel;
    ``programmatic``: launched as a programmatic dependent launch too (GPTFAST_CUDA_PDL=1)."""
    import gptfast_kernels.triton.kv_cache_attention as kv

    original, original_launch = kv._tuning, kv.programmatic_launch
    kv._tuning = lambda device, head_dim: (original(device, head_dim)[0]._replace(fused_combine=True), H100_SMS)
    if programmatic:
        kv.programmatic_launch = lambda device: True
    try:
        _kv_cache_attention(dtype, T, D, S, 0, heads, value_dim)
    finally:
        kv._tuning, kv.programmatic_launch = original, original_launch


def _verify_draft(greedy, V):
    from gptfast_kernels.triton.verify_draft import verify_draft_triton

    B, k = 2, 5
    verify_draft_triton(torch.zeros(B, k + 1, V), None if greedy else torch.zeros(B, k, V),
                        torch.zeros(B, k, dtype=torch.int64), torch.zeros(B, k + 1))


def _read_floor(block):
    """bench/read_floor.py's kernel over one int8 weight of 4096 x 4096, as the bench launches it."""
    from bench.read_floor import RowReader

    RowReader(torch.zeros(1, 4096 * 4096, dtype=torch.int8), block)()


DECODE = ["_kv_cache_attention_decode_kernel", "_kv_cache_attention_combine_kernel"]  # a 4k cache splits
PREFILL = ["_kv_cache_attention_scatter_kernel", "_kv_cache_attention_prefill_kernel"]
# case -> (the call, the kernels it must launch)
CASES = {
    **{f"int8_linear-{name}-M{M}": ((_int8_linear, dtype, M),
                                    ["_int8_linear_gemv_kernel" if M == 1 else "_int8_linear_tiled_kernel"])
       for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))
       for M in (1, 16, 64, 256)},
    "kv-decode-bf16": ((_kv_cache_attention, torch.bfloat16, 1, 128, 4096), DECODE),
    "kv-verify-bf16": ((_kv_cache_attention, torch.bfloat16, 5, 128, 4096), DECODE),
    "kv-decode-fp32": ((_kv_cache_attention, torch.float32, 1, 128, 4096), DECODE),
    "kv-decode-fp16-d256": ((_kv_cache_attention, torch.float16, 1, 256, 2048), DECODE),
    "kv-prefill-bf16": ((_kv_cache_attention, torch.bfloat16, 64, 128, 4096), PREFILL),
    "kv-prefill-fp32-d80": ((_kv_cache_attention, torch.float32, 37, 80, 512), PREFILL),
    "kv-ring-decode-bf16": ((_kv_cache_attention, torch.bfloat16, 1, 128, 4096 + 2047, 4096), DECODE),
    "kv-ring-prefill-bf16": ((_kv_cache_attention, torch.bfloat16, 64, 128, 1024 + 2047, 1024), PREFILL),
    # Gemma 4's global layers (D = 512): the large-head tiles; D = 320 pads to the same BLOCK_D
    "kv-decode-bf16-d512": ((_kv_cache_attention, torch.bfloat16, 1, 512, 4096), DECODE),
    "kv-verify-bf16-d512": ((_kv_cache_attention, torch.bfloat16, 5, 512, 4096), DECODE),
    "kv-decode-fp32-d512": ((_kv_cache_attention, torch.float32, 1, 512, 4096), DECODE),
    "kv-prefill-bf16-d512": ((_kv_cache_attention, torch.bfloat16, 64, 512, 4096), PREFILL),
    "kv-prefill-fp16-d320": ((_kv_cache_attention, torch.float16, 64, 320, 4096), PREFILL),
    "kv-prefill-fp32-d512": ((_kv_cache_attention, torch.float32, 37, 512, 512), PREFILL),
    # multi-head latent attention's latents (D = 576, MQA): 512 + a 64-wide tail; D = 520 runs the same tiles
    "kv-decode-bf16-d576": ((_kv_cache_attention, torch.bfloat16, 1, 576, 4096, 0, MLA_HEADS), DECODE),
    "kv-verify-bf16-d576": ((_kv_cache_attention, torch.bfloat16, 5, 576, 4096, 0, MLA_HEADS), DECODE),
    "kv-decode-fp16-d576": ((_kv_cache_attention, torch.float16, 1, 576, 4096, 0, MLA_HEADS), DECODE),
    "kv-prefill-bf16-d576": ((_kv_cache_attention, torch.bfloat16, 64, 576, 4096, 0, MLA_HEADS), PREFILL),
    "kv-decode-fp32-d576": ((_kv_cache_attention, torch.float32, 1, 576, 4096, 0, MLA_HEADS), DECODE),
    "kv-verify-fp32-d576": ((_kv_cache_attention, torch.float32, 5, 576, 4096, 0, MLA_HEADS), DECODE),
    "kv-prefill-fp32-d576": ((_kv_cache_attention, torch.float32, 37, 576, 512, 0, MLA_HEADS), PREFILL),
    "kv-prefill-bf16-d520": ((_kv_cache_attention, torch.bfloat16, 64, 520, 4096, 0, MLA_HEADS), PREFILL),
    # ... and as MLA runs them: values in the keys, the latent (value_dim 512) before the 64-wide rope part
    **{f"kv-{mode}-{name}-mla": ((_kv_cache_attention, dtype, T, 576, 4096, 0, MLA_HEADS, 512),
                                 PREFILL if T > 16 else DECODE)
       for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
       for mode, T in (("decode", 1), ("verify", 5), ("prefill", 64))},
    # Llama 4's chunked attention (Scout / Maverick: 40 / 8 heads of 128, chunks of 8192 tokens)
    **{f"kv-{mode}-bf16-chunked": ((_kv_cache_attention, torch.bfloat16, T, 128, 32768, 0, (40, 8), 0, 8192),
                                   PREFILL if T > 16 else DECODE)
       for mode, T in (("decode", 1), ("verify", 5), ("prefill", 64))},
    # ... in the ring buffers generation allocates them (8192 + 2047 slots)
    **{f"kv-{mode}-bf16-chunked-ring": ((_kv_cache_attention, torch.bfloat16, T, 128, 8192 + 2047, 0, (40, 8), 0, 8192,
                                         True), PREFILL if T > 16 else DECODE)
       for mode, T in (("decode", 1), ("verify", 5), ("prefill", 64))},
    # ALiBi (MPT-7B: 32 heads of 128, multi-head attention)
    **{f"kv-{mode}-bf16-alibi": ((_kv_cache_attention, torch.bfloat16, T, 128, 4096, 0, (32, 32), 0, 0, False, True),
                                 PREFILL if T > 16 else DECODE)
       for mode, T in (("decode", 1), ("verify", 5), ("prefill", 64))},
    **{f"kv-{mode}-bf16-pdl": ((_kv_cache_attention_programmatic, torch.bfloat16, T), DECODE)
       for mode, T in (("decode", 1), ("verify", 5))},
    **{f"kv-{mode}-{name}-fused_combine": ((_kv_cache_attention_fused_combine, dtype, T, *shape),
                                          ["_kv_cache_attention_decode_kernel"])
       for mode, T in (("decode", 1), ("verify", 5))
       for name, dtype, shape in (("bf16", torch.bfloat16, (128, 4096)), ("fp32", torch.float32, (128, 4096)),
                                  ("bf16-d512", torch.bfloat16, (512, 4096)),
                                  ("bf16-mla", torch.bfloat16, (576, 4096, MLA_HEADS, 512)))},
    # ... as a programmatic launch: the count's atomic and the combine after the wait, the next launch allowed late
    **{f"kv-{mode}-bf16-fused_combine-pdl": ((_kv_cache_attention_fused_combine, torch.bfloat16, T, 128, 4096,
                                              (32, 8), 0, True), ["_kv_cache_attention_decode_kernel"])
       for mode, T in (("decode", 1), ("verify", 5))},
    **{f"verify_draft-{mode}-V{V}": ((_verify_draft, mode == "greedy", V),
                                     ["_greedy_chunk_kernel", "_greedy_accept_kernel"] if mode == "greedy"
                                     else ["_sampling_kernel"])
       for mode in ("greedy", "sampling") for V in (128256, 50257)},
    **{f"bench-read_floor-{block}": ((_read_floor, block), ["_read_rows_kernel"]) for block in READ_FLOOR_BLOCKS},
}
# Cases whose attention kernels must not spill (a stack frame of 0 bytes). Prefill: the large-head
# tiles (gptfast_kernels/triton/kv_cache_attention.py, _GPU_LARGE_HEAD) were chosen for it; fp32
# being the correctness path, its prefill keeps a small frame (about 100 bytes at D = 512 / 576), and
# D = 520 (not a multiple of 16: no vectorised, pipelined loads) spills a little, as D = 500 does in
# the single-block tiles. Decode and verification: every case but fp32 at D = 128 (255 registers
# and a 56-byte frame), since the fused scatter moved ahead of the tile loop (stop 35; before, fp32
# verification at D = 576 took 32 registers and 4 KiB of stack). Values in the keys read K tiles
# only and keep no tail accumulator: MLA's kernels then need fewer registers and less shared memory.
SPILL_FREE = ("kv-prefill-bf16-d512", "kv-prefill-fp16-d320", "kv-prefill-bf16-d576", "kv-prefill-bf16-mla",
              "kv-prefill-fp16-mla",
              *(name for name, (_, kernels) in CASES.items() if kernels == DECODE and name != "kv-decode-fp32"),
              # the fused combine: fp32 as above; T = 5 at D = 128 keeps an 8-byte frame (128 registers)
              *(name for name in CASES if name.endswith("-fused_combine") and "-fp32-" not in name
                and name != "kv-verify-bf16-fused_combine"))
# Triton before 3.8 (3.6 checked: the GPU image's; 3.7 not tried) leaves a small frame in two of those
# (cuobjdump -sass, sm_90a), at 128 registers, neither in the tile loop: verification at D = 512 saves
# one register before the loop and reloads it after (8 bytes); MLA's decode with the fused combine (off
# by default) keeps five numbers for its combine loop (24 bytes).
FRAMES_BEFORE_TRITON_3_8 = {"kv-verify-bf16-d512": 8, "kv-decode-bf16-mla-fused_combine": 24}


def _frame_allowed(case: str) -> int:
    import triton

    older = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 8)
    return FRAMES_BEFORE_TRITON_3_8.get(case, 0) if older else 0


# -- the child: capture and compile ---------------------------------------------------------------

def _signature(jit_fn, args: dict):
    """Triton's own specialisation of the arguments, as a GPU launch would make it: ints equal to 1
    become constants and multiples of 16 (values and pointers) get a divisibility hint."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(jit_fn.arg_names, jit_fn.params)):
        value = args[name] if name in args or not param.has_default else param.default
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if not param.do_not_specialize and value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if not param.do_not_specialize and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value).__name__}")
    return signature, constexprs, attrs


def _compile_for_sm90(jit_fn, args, kwargs) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "launch_pdl") if key in kwargs}
    signature, constexprs, attrs = _signature(jit_fn, dict(zip(jit_fn.arg_names, args), **kwargs))
    source = ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", SM90, 32), options=options)
    cubin = compiled.asm.get("cubin", b"")
    ptx = compiled.asm.get("ptx", "")
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    global_loads = re.findall(r"ld\.global\S*", ptx)
    atomics = re.findall(r"atom\.\S*", ptx)
    return {"kernel": jit_fn.fn.__name__, "shared": compiled.metadata.shared, "cubin_bytes": len(cubin),
            "griddepcontrol": wait >= 0, "launch_dependents_after_wait": 0 <= wait < launch,
            "global_loads": sorted(set(global_loads)), "atomics": sorted(set(atomics)),
            **_resource_usage(cubin)}


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack frame bytes (spills, when > 0) from cuobjdump, {} without it."""
    import triton

    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except (AttributeError, RuntimeError):  # not bundled with this Triton
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return {"registers": int(usage[1]), "stack": int(usage[2])} if usage else {}


def _child_main() -> None:
    from triton.runtime.jit import JITFunction

    import gptfast_kernels.triton.kv_cache_attention as kv

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    kv._tuning = lambda device, head_dim: (kv._gpu_tuning(head_dim), H100_SMS)  # the H100 tuning, as on a GPU
    results = {}
    for name, ((call, *call_args), _) in CASES.items():
        launches.clear()
        try:
            call(*call_args)
            results[name] = [_compile_for_sm90(*launch) for launch in launches]
        except Exception as error:  # noqa: BLE001  (reported per case by the tests)
            results[name] = f"{type(error).__name__}: {error}"[-3000:]
    print(_MARK + json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    if not _extension.triton_available():
        pytest.skip("requires Triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests run these kernels for real")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", f"import {__name__} as m; m._child_main()"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len(_MARK):])


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90(compiled, case):
    result = compiled[case]
    assert isinstance(result, list), result
    assert [r["kernel"] for r in result] == CASES[case][1]
    if case.endswith("-pdl"):  # griddepcontrol made it into both kernels, the next launch allowed late
        assert all(r["griddepcontrol"] and r["launch_dependents_after_wait"] for r in result), result
    if case.startswith("kv-"):  # the fused combine's count, acquire-release at GPU scope; nothing else
        want = ["atom.global.gpu.acq_rel.add.u32"] if "-fused_combine" in case else []
        assert all(r["atomics"] == want for r in result), [r["atomics"] for r in result]
    for r in result:
        print(f"{case} {r['kernel']}: {r.get('registers', '?')} registers, stack frame {r.get('stack', '?')} bytes, "
              f"{r['shared']} bytes of shared memory")
        assert r["cubin_bytes"] > 0, r
        assert r["shared"] <= H100_MAX_SHARED_BYTES, \
            f"{r['kernel']}: {r['shared']} bytes of shared memory, an H100 block has at most {H100_MAX_SHARED_BYTES}"
        if case in SPILL_FREE and "stack" in r:
            assert r["stack"] <= _frame_allowed(case), f"{r['kernel']} spills: a stack frame of {r['stack']} bytes"


@pytest.mark.parametrize("block", READ_FLOOR_BLOCKS)
def test_read_floor_streams_with_16_byte_loads(compiled, block):
    """The bench's read floor is a floor only if it reads as the fastest kernels do: every load of
    the weights one 16-byte vector (ld.global...v4.b32), no spills."""
    [result] = compiled[f"bench-read_floor-{block}"]
    assert result["global_loads"] and all(load.endswith(".v4.b32") for load in result["global_loads"]), result
    if "stack" in result:
        assert result["stack"] == 0, result
