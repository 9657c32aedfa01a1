"""``python -m gptfast_kernels <info|demo|bench|quantize|generate>`` (installed as ``gptfast-kernels``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

import torch

from gptfast_kernels.generate_cli import DTYPES, add_generate_parser, cli_device


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(_args) -> int:
    import gptfast_kernels
    from gptfast_kernels import _extension
    from gptfast_kernels.models.families import FAMILIES

    print(f"gptfast_kernels {gptfast_kernels.__version__}")
    print(f"torch           {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"triton          {_version('triton')}")
    print(f"transformers    {_version('transformers')}")
    if _extension.extension_loaded():
        print("extension       gptfast_kernels._C loaded")
    else:
        print(f"extension       NOT loaded ({_extension.EXTENSION_ERROR})")
    print(f"compiled        cpu={_extension.extension_loaded()} cuda={_extension.cuda_compiled()}")
    if _extension.extension_loaded() and hasattr(torch.ops.gptfast_kernels, "_cpu_isas"):
        builds = torch.ops.gptfast_kernels._cpu_isas()
        print(f"cpu kernels     {torch.ops.gptfast_kernels._cpu_isa()} "
              f"(this CPU runs: {', '.join(builds)}; GPTFAST_KERNELS_CPU_ISA picks one)")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"GPU             {gpu}")
    print(f"usable on cpu   {sorted(_extension.usable_backends(torch.device('cpu')))}")
    if torch.cuda.is_available():
        print(f"usable on cuda  {sorted(_extension.usable_backends(torch.device('cuda')))}")
    print(f"model families  {', '.join(FAMILIES)} (patch_model)")
    return 0


def cmd_bench(bench_argv: list[str]) -> int:
    # bench/ lives beside the package in a source checkout (pip install -e .).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "bench")):
        print("gptfast_kernels bench: needs a source checkout (bench/ beside the package); "
              "install with `pip install --no-build-isolation -e .`", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    from bench.run import main as bench_main

    return bench_main(bench_argv)




def _add_quantize_parser(sub):
    parser = sub.add_parser("quantize", help="patch a checkpoint (int8 weights) and save it for load_patched")
    parser.add_argument("model", help="a local checkpoint or hub name (from_pretrained)")
    parser.add_argument("output", help="the directory to write (save_patched), with the model's tokenizer")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="the float weights' and activations' dtype (default bfloat16)")
    parser.add_argument("--int8-skip", nargs="*", default=[], metavar="NAME",
                        help="layers left float (names or patterns, as patch_model's int8_skip)")
    parser.add_argument("--device", default="cpu",
                        help="where to load and quantize (default cpu: the float model must fit there)")
    parser.add_argument("--trust-remote-code", action="store_true")
    return cmd_quantize


def cmd_quantize(args) -> int:
    """from_pretrained, patch_model (int8), save_patched, and the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptfast_kernels import patch_model, save_patched
    from gptfast_kernels.models.serialization import is_saved_patched

    try:
        device = cli_device("quantize", args.device)
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    problem = _quantize_paths_problem(args.model, args.output, is_saved_patched(args.model))
    if problem:  # (before loading: a model takes a while to load)
        print(f"quantize: {problem}", file=sys.stderr)
        return 2
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype],
                                                     trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        print(f"quantize: cannot load model {args.model!r}: {error}", file=sys.stderr)
        return 2
    model = model.to(device).eval()
    float_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    try:
        patch_model(model, int8=True, int8_skip=tuple(args.int8_skip))
        save_patched(model, args.output)
    except (OSError, ValueError) as error:  # (a family patch_model does not serve, an unwritable output)
        print(f"quantize: {error}", file=sys.stderr)
        return 2
    int8_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"quantize: {args.model} -> {args.output}: {float_bytes / 1e9:.3f} GB of {args.dtype} weights -> "
          f"{int8_bytes / 1e9:.3f} GB (load it with gptfast_kernels.load_patched)")
    try:
        AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code).save_pretrained(args.output)
    except (OSError, ValueError) as error:  # a checkpoint without a tokenizer still quantizes
        print(f"quantize: no tokenizer saved ({type(error).__name__}: {error})")
    return 0


def _quantize_paths_problem(model: str, output: str, model_is_saved_patched: bool) -> str | None:
    """What is wrong with quantize's MODEL / OUTPUT pair, or None."""
    if model_is_saved_patched:  # (from_pretrained finds none of its int8 weights: every layer random)
        return (f"{model!r} is a directory save_patched wrote (already int8); load it with load_patched, or "
                "quantize the float checkpoint it came from")
    if os.path.exists(output) and not os.path.isdir(output):
        return f"output {output!r} is a file; give a directory"
    if os.path.isdir(model) and os.path.exists(output) and os.path.samefile(model, output):
        return f"output {output!r} is the model's own directory; give a new one"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptfast_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions and which backends are compiled / usable")
    sub.add_parser("bench", help="kernel microbenchmarks (table + JSON); `bench --help` for options")
    commands = {"info": cmd_info, "quantize": _add_quantize_parser(sub), "generate": add_generate_parser(sub)}
    try:
        from gptfast_kernels.demo import add_demo_parser
    except ImportError:
        add_demo_parser = None
    if add_demo_parser is not None:
        commands["demo"] = add_demo_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench/run.py owns its options
        return cmd_bench(argv[1:])
    args = parser.parse_args(argv)
    return commands[args.command](args)
