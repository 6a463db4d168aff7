"""The megatron-core side: runtime set-up (CPU compatibility included), building the GPTModel, the policy actor
(:mod:`.policy`, one rank of the TP x PP x DP training world; :mod:`.actor_group`, its Ray actors), checkpoints.

Dependency direction: this package imports the algorithms and kernels, never :mod:`da3po_megatron.bridge`. The policy
does not know HF names: it holds Megatron parameters under Megatron names, and HF weights go in and out of it through
the bridge, which imports this package and is run on each policy rank by whoever needs it (the trainer, the weight
sync, the converter, tests) through ``PolicyWorker.execute`` / ``PolicyGroup.run_on_all``.
"""
