"""The megatron-core side: runtime set-up (CPU compatibility included), the model's architecture in Megatron terms
(:class:`.arch.GPTArch`), building the GPTModel from it (:mod:`.model`), the policy actor (:mod:`.policy`, one rank of
the TP x PP x DP training world; :mod:`.actor_group`, its Ray actors), checkpoints, the memory estimate.

Dependency direction: bridge -> megatron, one way. This package imports the algorithms and kernels, never
:mod:`da3po_megatron.bridge`, and never reads a Hugging Face config: the policy is built from a ``GPTArch`` that its
caller (the trainer, tools, tests) gets from the bridge (``bridge.hf_config.gpt_arch(model_path)``). It holds Megatron
parameters under Megatron names; HF weights go in and out of it through the bridge, which imports this package and is
run on each policy rank by whoever needs it (the trainer, the weight sync, the converter, tests) through
``PolicyWorker.execute`` / ``PolicyGroup.run_on_all``. ``tests/test_bridge.py`` checks both rules.
"""
