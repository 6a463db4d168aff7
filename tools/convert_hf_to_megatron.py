"""Convert a Hugging Face checkpoint to a Megatron dist checkpoint: ``da3po convert hf-to-megatron`` (same flags).

    python tools/convert_hf_to_megatron.py --hf HF_DIR --out CKPT_DIR --tp 2 --pp 1 [--verify] [--force]
"""

import sys

from da3po_megatron.bridge.convert import main

if __name__ == "__main__":  # the converter spawns processes: keep the guard
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
