"""Saving a patched model and loading it back with its int8 weights, never building the float ones.

``save_patched(model, directory)`` writes transformers' ``config.json`` and ``generation_config.json``,
``gptfast_kernels.json`` (how the model was patched, its dtype, the package's version, which file
holds which tensor, and the numbers a dynamic RoPE module keeps beside its frequencies) and
``model.safetensors`` (or files of at most 5 GiB each, ``model-00001-of-0000N.safetensors``): every
parameter and buffer of the patched model, the int8 ``qweight`` / ``scales`` of its Int8Linear and
Int8Experts included, and its non-persistent buffers too (RoPE frequencies, position tables, ALiBi
slopes), so that loading needs none of the model's init code to recompute them. A tensor that
several names share (tied weights that int8 keeps tied) is written once, the other names recorded
as aliases of it.

``load_patched(directory, device=...)`` builds the model from its config on the meta device (no
memory), patches it the same way (int8 layers of meta tensors), and assigns the saved tensors,
read straight onto ``device``: a model whose float weights would not fit the device loads in its
int8 size (Llama-3-70B: about 70 GB, not 140). The result equals the saved model bit for bit.
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

import gptfast_kernels
from gptfast_kernels.models.patch import is_patched, patch_model

WEIGHTS_FILE = "model.safetensors"  # the one file of a model that fits one shard
# files past this size start a new one (as transformers' max_shard_size): bounds the host memory a save takes
MAX_SHARD_BYTES = 5 * 1024 ** 3
_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
PATCH_FILE = "gptfast_kernels.json"
# bumped when what save_patched writes changes in a way an older load_patched could not read
FORMAT_VERSION = 1
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16)}
_PATCH_FILE_KEYS = ("model_class", "dtype", "patch", "weights", "aliases")
_PATCH_OPTIONS = ("int8", "fused_attention", "int8_skip")  # what "patch" holds: patch_model's keywords
# what another checkpoint's directory holds (transformers' weights and index files, its config): never
# overwritten by save_patched
_OTHER_CHECKPOINT = re.compile(r"config\.json|.*\.(safetensors|bin|h5|msgpack|ckpt|pt|pth)|.*\.index\.json")
# the plain (non-tensor) attributes of a RoPE module that its forward updates: dynamic NTK's cached
# length and the attention scaling it computed (per layer type too); saved, for the frequencies saved
# with them mean what they meant
_ROPE_STATE = re.compile(r"(\w+_)?(max_seq_len_cached|attention_scaling)")


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its full name, persistent or not, shared ones under each name."""
    named = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in (module._parameters, module._buffers):
            for name, tensor in kind.items():
                if tensor is not None:
                    named[f"{prefix}.{name}" if prefix else name] = tensor
    return named


def _view_key(tensor: torch.Tensor):
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def _shard_name(index: int, count: int) -> str:
    return WEIGHTS_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into runs of at most ``max_shard_bytes`` (a larger tensor alone in its own)."""
    shards, current, current_bytes = [], [], 0
    for name, size in sizes.items():
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return [*shards, current] if current else shards


def save_patched(model: nn.Module, directory: str | os.PathLike, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Writes a model that ``patch_model`` patched to ``directory`` (created if missing), for
    ``load_patched``. Its weights are written as they are now (int8 where patched so), in files of at
    most ``max_shard_bytes`` (one tensor larger than that gets a file of its own): only one file's
    tensors are copied to host memory at a time."""
    from safetensors.torch import save_file

    model = getattr(model, "_orig_mod", model)  # (torch.compile's wrapper: the model it compiled)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"save_patched: model must be a transformers model, got {type(model).__name__}")
    options = getattr(model, "_gptfast_patch_options", None)
    if not is_patched(model) or options is None:
        raise ValueError("save_patched: model is not patched; call patch_model(model) first (an unpatched model "
                         "saves with its own save_pretrained)")
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"save_patched: directory must be a path, got {type(directory).__name__}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"save_patched: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    named = _named_tensors(model)
    meta = [name for name, tensor in named.items() if tensor.device.type == "meta"]
    if meta:
        raise ValueError(f"save_patched: model has tensors on the meta device (no data to save), e.g. {meta[0]!r}")
    stored, aliases, first_of_view = {}, {}, {}
    for name, tensor in named.items():
        key = _view_key(tensor)
        if key in first_of_view:  # the same tensor under another name: written once
            aliases[name] = first_of_view[key]
        else:
            first_of_view[key] = name
            stored[name] = tensor.detach()
    shards = _shards({name: t.numel() * t.element_size() for name, t in stored.items()}, max_shard_bytes)
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"save_patched: directory {directory!r} is a file")
    os.makedirs(directory, exist_ok=True)
    present = os.listdir(directory)
    weights = [name for name in present if _SHARD_FILE.fullmatch(name)]
    others = sorted((name for name in present if _OTHER_CHECKPOINT.fullmatch(name)),
                    key=lambda name: (name == "config.json", name))  # (its weights named first)
    if others and PATCH_FILE not in present:  # (another checkpoint: never overwritten or removed)
        raise ValueError(f"save_patched: directory {directory!r} holds {others[0]!r} that save_patched did not "
                         "write (another checkpoint?); choose a new or empty directory")
    for old in present:  # a model saved here before: its index goes first, its files with it
        if old == PATCH_FILE or old in weights:
            os.remove(os.path.join(directory, old))
    model.config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    files = {}
    for index, names in enumerate(shards):
        file = _shard_name(index, len(shards))
        # (safetensors refuses tensors that share memory: each is written from a copy of its own)
        save_file({name: stored[name].to("cpu", copy=True).contiguous() for name in names},
                  os.path.join(directory, file), metadata={"format": "pt"})
        files.update(dict.fromkeys(names, file))
    with open(os.path.join(directory, PATCH_FILE), "w") as f:  # (last: it makes the directory loadable)
        json.dump({"format_version": FORMAT_VERSION, "gptfast_kernels_version": gptfast_kernels.__version__,
                   "model_class": type(model).__name__, "dtype": str(model.dtype), "patch": options,
                   "weights": files, "aliases": aliases, "rope_state": _rope_state(model)}, f, indent=2,
                  sort_keys=True)


def _rope_state(model: nn.Module) -> dict[str, dict[str, int | float]]:
    """Each RoPE module's _ROPE_STATE attributes by module name (a dynamic-NTK module grown past
    its table keeps scaled frequencies, which a short input resets only while it remembers the
    length it grew to)."""
    state = {}
    for name, module in model.named_modules():
        numbers = {attribute: value.item() if isinstance(value, torch.Tensor) else value
                   for attribute, value in vars(module).items() if _ROPE_STATE.fullmatch(attribute) and (
                       isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.numel() == 1)
                   and not isinstance(value, bool)}  # (a grown length is a 0-d tensor: the positions' max + 1)
        if numbers and hasattr(module, "inv_freq"):
            state[name] = numbers
    return state


def _read_patch_file(directory: str) -> dict:
    path = os.path.join(directory, PATCH_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"load_patched: directory {directory!r} holds no {PATCH_FILE}: it was not written by "
                         "save_patched (a float checkpoint loads with from_pretrained, then patch_model)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:  # (json's decode error is a ValueError)
        raise ValueError(f"load_patched: cannot read {path}: {error}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"load_patched: {path} holds a {type(saved).__name__}, not as save_patched writes it")
    if saved.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"load_patched: {path} has format version {saved.get('format_version')!r}; this "
                         f"gptfast_kernels {gptfast_kernels.__version__} reads version {FORMAT_VERSION}")
    missing = [key for key in _PATCH_FILE_KEYS if key not in saved]
    if missing:
        raise ValueError(f"load_patched: {path} lacks {missing}: not as save_patched writes it")
    if saved.get("dtype") not in _DTYPES:
        raise ValueError(f"load_patched: {path} names dtype {saved.get('dtype')!r}, expected one of {list(_DTYPES)}")
    patch = saved["patch"]
    if not isinstance(patch, dict) or sorted(patch) != sorted(_PATCH_OPTIONS):
        raise ValueError(f"load_patched: {path}'s patch must hold {list(_PATCH_OPTIONS)}, got {patch!r}")
    weights, aliases = saved["weights"], saved["aliases"]
    if not (isinstance(weights, dict) and isinstance(aliases, dict)
            and all(isinstance(name, str) for name in [*weights, *aliases, *aliases.values()])):
        raise ValueError(f"load_patched: {path}'s weights and aliases must map tensor names to names")
    for file in sorted(set(weights.values())):  # (files of this directory only, as save_patched names them)
        if not isinstance(file, str) or not _SHARD_FILE.fullmatch(file):
            raise ValueError(f"load_patched: {path} names weights file {file!r}, not one save_patched writes")
        if not os.path.isfile(os.path.join(directory, file)):
            raise ValueError(f"load_patched: {directory!r} lacks {file!r}, which {PATCH_FILE} names")
    rope_state = saved.get("rope_state", {})  # (absent in files written before it was saved)
    if not isinstance(rope_state, dict) or not all(
            isinstance(numbers, dict) and all(_ROPE_STATE.fullmatch(str(attribute)) and isinstance(value, (int, float))
                                              and not isinstance(value, bool) for attribute, value in numbers.items())
            for numbers in rope_state.values()):
        raise ValueError(f"load_patched: {path}'s rope_state is not as save_patched writes it")
    return saved


def is_saved_patched(directory) -> bool:
    """Whether ``directory`` holds a model written by ``save_patched``."""
    return isinstance(directory, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(directory), PATCH_FILE))


def load_patched(directory: str | os.PathLike, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The model ``save_patched`` wrote to ``directory``, patched as it was, its tensors on ``device``
    (default: CUDA where available, else the CPU), in eval mode. No float copy of an int8 weight is
    made on the way. ``dtype`` (float32 / float16 / bfloat16; default: the saved one): the model is
    built in it, and each saved float tensor is converted to the dtype its place in that model has
    (weights and activations in ``dtype``; what the model keeps in float32 whatever its dtype, such
    as RoPE frequencies, stays so); int8 weights are read as they are."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"load_patched: directory must be a path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"load_patched: directory {directory!r} "
                         f"{'is a file' if os.path.exists(directory) else 'does not exist'}")
    saved = _read_patch_file(directory)
    if dtype is not None and dtype not in _DTYPES.values():
        raise ValueError(f"load_patched: dtype must be None or one of {list(_DTYPES)}, got {dtype!r}")
    convert = dtype is not None and dtype != _DTYPES[saved["dtype"]]
    device = _check_device(device)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"load_patched: directory {directory!r} lacks config.json, which save_patched writes")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype if convert else _DTYPES[saved["dtype"]],
                                                 trust_remote_code=trust_remote_code)
    if type(model).__name__ != saved["model_class"]:
        raise ValueError(f"load_patched: {directory!r} holds a {saved['model_class']}, but its config builds a "
                         f"{type(model).__name__} here (another transformers version?)")
    patch_model(model, **saved["patch"])
    files, aliases = saved["weights"], saved["aliases"]
    expected = _named_tensors(model)
    missing, unexpected = sorted(set(expected) - {*files, *aliases}), sorted({*files, *aliases} - set(expected))
    if missing or unexpected:
        raise ValueError(f"load_patched: {directory!r} does not match the model its config builds here "
                         f"(another transformers or gptfast_kernels version?): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for file in sorted(set(files.values())):
        try:
            tensors = load_file(os.path.join(directory, file), device=str(device))
        except Exception as error:  # (safetensors' own error type for a damaged file; an OSError)
            raise ValueError(f"load_patched: cannot read {os.path.join(directory, file)!r}: {error}") from None
        names = sorted(name for name, its_file in files.items() if its_file == file)
        if sorted(tensors) != names:
            raise ValueError(f"load_patched: {os.path.join(directory, file)!r} does not hold the tensors "
                             f"{PATCH_FILE} lists for it")
        for name in names:
            _assign(model, name, tensors.pop(name), directory, convert)
    for alias, name in aliases.items():  # the very tensor (Parameter) of its name: tied as saved
        slot, leaf = _slot(model, name)
        _assign(model, alias, slot[leaf], directory)
    _check_no_meta(model, directory)
    for name, numbers in saved.get("rope_state", {}).items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"load_patched: {directory!r} saved RoPE state for {name!r}, which the model its "
                             "config builds here lacks") from None
        for attribute, value in numbers.items():
            setattr(module, attribute, value)
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def _assign(model: nn.Module, name: str, tensor: torch.Tensor, directory: str, convert: bool = False) -> None:
    """Puts ``tensor`` in the place of the model's meta tensor ``name`` (a Parameter stays a Parameter);
    with ``convert``, a float tensor in the dtype of that place."""
    slot, leaf = _slot(model, name)
    old = slot[leaf]
    if convert and old.dtype.is_floating_point and tensor.dtype.is_floating_point:
        tensor = tensor.to(old.dtype)
    # (a float tensor may come in another float dtype: the saved model's, after model.to(dtype), is kept;
    # a table the model grows as it goes, a non-persistent buffer such as XGLM's sinusoidal positions,
    # in the size it had grown to)
    grown = leaf in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
    if (tuple(old.shape) != tuple(tensor.shape) and not (grown and old.dim() == tensor.dim())) or (
            old.dtype != tensor.dtype and not (
            old.dtype.is_floating_point and tensor.dtype.is_floating_point)):
        raise ValueError(f"load_patched: {name} is {tuple(tensor.shape)} {tensor.dtype} in {directory!r}, but "
                         f"{tuple(old.shape)} {old.dtype} in the model its config builds here")
    if isinstance(old, nn.Parameter) and not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
    slot[leaf] = tensor


def _check_device(device) -> torch.device:
    """load_patched's ``device`` (None: CUDA where available, else the CPU) as a torch.device;
    ValueError naming it for what is no device, holds no data, or is a GPU torch does not see."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"load_patched: device {device!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "meta":
        raise ValueError("load_patched: device must hold data (cpu, cuda, ...), got meta")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"load_patched: device {device} is not there: torch sees {count} CUDA device(s)")
    return device


def _slot(model: nn.Module, name: str) -> tuple[dict, str]:
    """The dict (a module's parameters or buffers) holding tensor ``name``, and its key there."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return (module._parameters if leaf in module._parameters else module._buffers), leaf


def _check_no_meta(model: nn.Module, directory: str) -> None:
    """A tensor still on the meta device (a parameter, a buffer, or a tensor a module keeps as a plain
    attribute, made at patch time) would fail at the first forward: name it here instead."""
    attributes = {f"{prefix}.{attribute}" if prefix else attribute: value
                  for prefix, module in model.named_modules() for attribute, value in vars(module).items()}
    for name, value in {**attributes, **_named_tensors(model)}.items():
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise ValueError(f"load_patched: {name} has no saved value in {directory!r}; this model cannot be "
                             "loaded by load_patched")
