"""Where the actors run, how they start and how they stop: the placement plan (``placement``, pure) and its Ray side
(``placement_ray``), bring-up (``bringup``: Ray up, plan reserved, policy and engines started, transport chosen),
colocation's offload cycle and weight push (``colocation``), the orphan reaper (``reaper``) and stop signals
(``signals``)."""
