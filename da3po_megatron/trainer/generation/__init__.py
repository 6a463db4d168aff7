"""Phase 1 of Algorithm 1 in every mode: prompts -> engines -> rewards -> dynamic sampling. The ``Sampler`` owns the
prompt stream, the sampling, the engines' calls, the rewards and its own saved state; ``collect`` fills one step's
batch with it (rounds or streaming), the prefetch and the asynchronous producer run it beside the loop, ``replay``
dumps and replays steps, ``rescore`` re-scores a step's decisions. Nothing here imports ``trainer.run`` or
``trainer.resume``."""
