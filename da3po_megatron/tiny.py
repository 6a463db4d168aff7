"""Tiny Hugging Face models and a character-level tokenizer, built locally (no downloads).

The CPU demo, the tests and the algorithm comparison all start from these: a real `transformers` checkpoint directory
(config.json, model.safetensors, tokenizer files, generation_config.json) of a few hundred thousand parameters, in the
model families the bridge supports (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3). vLLM's CPU attention needs head_dim >= 32,
so every family keeps head_dim = 32.

The tiny Qwen3-MoE (``family="qwen3_moe"``, :func:`build_moe_model`): 8 experts, top-2, ``norm_topk_prob``, expert
width 64, two layers of which layer 1 is dense through ``mlp_only_layers`` -- every MoE code path (router, experts,
a dense layer beside them) at a few hundred thousand parameters.

The tokenizer is character level: every printable ASCII character and newline is one token, plus the specials
``<pad> <s> </s> <|im_start|> <|im_end|>`` and a ChatML chat template. One token per digit makes the synthetic
arithmetic tasks learnable by a tiny model.

Real proportions (:data:`REAL_SHAPES`, :func:`real_shape`): the models the recipes name, shrunk keeping their ratios
(expert width to hidden, dense width to hidden, tied or untied head). The defaults above stay as they are (the existing
tests assert on them and are timed at that size); tests of shipped shapes take ``real_shape(name)``.

Command line: ``python -m da3po_megatron.tiny OUT_DIR [--family qwen3] [--seed 0] [--like Qwen3-30B-A3B]``.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama")
# The tiny MoE's shape (Qwen3-30B-A3B has 128 experts, top-8, expert width 768, no dense layer).
MOE_DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                    mlp_only_layers=[1], decoder_sparse_step=1)
HEAD_DIM = 32

# Tiny models at the proportions of the models the recipes name (issue 46: a square or kernel-aligned toy shape hides
# shape bugs). Each entry: the real config's figures, then the shrink. head_dim 32 everywhere (vLLM CPU attention's
# smallest); KV heads at least the recipes' largest TP (4), which bounds how far the GQA ratio can follow.
REAL_SHAPES: dict[str, dict] = {
    # Qwen3-4B(-Base): hidden 2560, intermediate 9728 (3.8x), 32 heads x 128 (q width 1.6x hidden), 8 KV heads, 36
    # layers, tied embeddings (Qwen3 technical report, Table 1: 0.6B/1.7B/4B tie, 8B and up do not).
    "Qwen3-4B": dict(family="qwen3", hidden_size=160, ffn_hidden_size=608, num_heads=8, num_kv_heads=2,
                     num_layers=2, tie_word_embeddings=True),
    # Qwen3-8B(-Base): hidden 4096, intermediate 12288 (3x), 32 heads x 128 (q width 1x), 8 KV heads, untied head.
    "Qwen3-8B": dict(family="qwen3", hidden_size=256, ffn_hidden_size=768, num_heads=8, num_kv_heads=4,
                     num_layers=2, tie_word_embeddings=False),
    # Qwen3-30B-A3B(-Base): hidden 2048, moe_intermediate 768 (0.375x: 2 x 768 != 2048, and 768 is a multiple of 32
    # where the tiny width 48 is not -- vLLM's CPU kernel pads it), intermediate 6144 (3x; no dense layer uses it),
    # 128 experts top-8 (16:1), 32 heads x 128 (q width 2x), 4 KV heads, 48 layers, untied head.
    "Qwen3-30B-A3B": dict(family="qwen3_moe", hidden_size=128, ffn_hidden_size=384, moe_intermediate_size=48,
                          num_experts=32, num_experts_per_tok=2, mlp_only_layers=[], num_heads=8, num_kv_heads=4,
                          num_layers=2, tie_word_embeddings=False),
}


def real_shape(model: str) -> dict:
    """:data:`REAL_SHAPES`' entry for a model name or path (``checkpoints/Qwen3-30B-A3B-Base`` ->
    ``Qwen3-30B-A3B``; suffixes such as ``-Base`` / ``-Instruct`` are ignored): keyword arguments of
    :func:`build_model`, ``family`` included. Raises naming the known shapes."""
    name = Path(str(model).rstrip("/")).name.lower()
    for key in sorted(REAL_SHAPES, key=len, reverse=True):
        if name == key.lower() or name.startswith(key.lower() + "-"):
            return {k: (list(v) if isinstance(v, list) else v) for k, v in REAL_SHAPES[key].items()}
    raise ValueError(f"no tiny shape for model {model!r}: known {sorted(REAL_SHAPES)} (tiny.REAL_SHAPES)")


def _chars() -> list[str]:
    return [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable characters + "\n"


def build_tokenizer(out_dir: str | Path | None = None):
    """A character-level `PreTrainedTokenizerFast` with a ChatML template; saved to ``out_dir`` when given.

    ``<|im_end|>`` is the end-of-sequence token, so generation after the chat template stops at the end of the turn.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + _chars())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["</s>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast


def hf_config(
    family: str = "qwen3",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    bos_token_id: int = 1,
    eos_token_id: int = 5,
    pad_token_id: int = 0,
    **moe,
):
    """A `transformers` config of the given family with head_dim 32 (Qwen2/Llama derive it as hidden / heads).
    ``moe``: Qwen3-MoE keys over :data:`MOE_DEFAULTS` (``num_experts``, ``mlp_only_layers``, ...)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if moe and family != "qwen3_moe":
        raise ValueError(f"MoE options {sorted(moe)} need family='qwen3_moe', got {family!r}")
    if family == "qwen3":
        return Qwen3Config(head_dim=HEAD_DIM, rope_theta=1_000_000.0, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=HEAD_DIM, rope_theta=1_000_000.0, router_aux_loss_coef=0.0,
                              **{**MOE_DEFAULTS, **moe}, **common)
    if hidden_size // num_heads != HEAD_DIM:
        raise ValueError(f"{family}: hidden_size / num_heads must be {HEAD_DIM} (vLLM CPU attention), got "
                         f"{hidden_size}/{num_heads}")
    if family == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, **common)
    return LlamaConfig(rope_theta=500_000.0, attention_bias=False, mlp_bias=False, **common)


def build_model(
    out_dir: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    init_std: float = 0.2,
    router_tie: float = 0.0,
    **config_kwargs,
) -> Path:
    """Write a tiny randomly initialised HF checkpoint (model + tokenizer + generation config) to ``out_dir``.

    ``init_std`` above the usual 0.02 makes sampled distributions far from uniform, so log-prob comparisons between
    engines are meaningful. Qwen2/Llama default to hidden 128 with 4 heads (head_dim 32).

    ``router_tie`` (Qwen3-MoE): every router row is one shared random row plus noise of this std, so the experts'
    logits are near-tied and the top-k is decided by differences of that size -- with ``router_tie`` ~1e-6 by the
    rounding differences between two implementations of the same weights (vLLM vs megatron-core): the tiny model
    then routes differently in engine and policy, the mismatch routing replay (R3) removes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out)
    if family not in ("qwen3", "qwen3_moe"):
        config_kwargs.setdefault("hidden_size", 128)
    cfg = hf_config(
        family,
        vocab_size=max(128, len(tok)),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
            elif "bias" in name:
                p.normal_(0.0, init_std)
        if router_tie > 0:
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight") and p.dim() == 2:
                    p.copy_(p[:1].expand_as(p) + router_tie * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    return out


def build_moe_model(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, router_tie: float = 0.0,
                    **config_kwargs) -> Path:
    """The tiny Qwen3-MoE checkpoint (:data:`MOE_DEFAULTS`; override any key, e.g. ``mlp_only_layers=[]``),
    saved per expert as the Hub's Qwen3-MoE checkpoints are (``model.layers.N.mlp.experts.E.{gate,up,down}_proj``,
    router ``model.layers.N.mlp.gate.weight``). ``router_tie``: near-tied router logits (:func:`build_model`)."""
    return build_model(out_dir, "qwen3_moe", seed, init_std, router_tie=router_tie, **config_kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--family", default="qwen3", choices=FAMILIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--like", default=None, choices=sorted(REAL_SHAPES),
                    help="the proportions of this model (tiny.REAL_SHAPES; sets the family, ignores --family)")
    args = ap.parse_args(argv)
    kw = {"num_layers": args.num_layers}
    if args.hidden_size:
        kw["hidden_size"] = args.hidden_size
    if args.like:
        kw = {**real_shape(args.like), **({"hidden_size": args.hidden_size} if args.hidden_size else {})}
    family = kw.pop("family", args.family)
    out = build_model(args.out_dir, family, args.seed, **kw)
    cfg = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: {cfg['architectures'][0]} hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
          f"vocab={cfg['vocab_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
