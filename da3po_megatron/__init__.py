"""da3po-megatron: DA3PO (DAPO + Direct Advantage Amplification) on megatron-core, vLLM and Ray.

Package map (dependency direction top to bottom; lower layers never import upper ones):
  algorithms/, kernels/   pure torch math and the fused loss kernel (import nothing of the project)
  megatron/, bridge/, rollout/, rewards/, data/, eval/   runtime parts (import algorithms at most)
  trainer/                the RL loop that wires them
  cli.py                  `da3po train | eval | convert | bench | theory`
"""

__version__ = "0.1.0"
