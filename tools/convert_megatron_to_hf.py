"""Convert a Megatron dist checkpoint (any TP x PP) to Hugging Face safetensors: ``da3po convert megatron-to-hf``.

    python tools/convert_megatron_to_hf.py --ckpt CKPT_DIR --out HF_DIR [--max-shard-size 5GB] [--verify] [--force]
"""

import sys

from da3po_megatron.bridge.convert import main

if __name__ == "__main__":  # --verify spawns processes: keep the guard
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
