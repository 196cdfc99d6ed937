"""The TreeGraft scheduler: when the strong drafter is worth a call, decided by rules and learned offline.

Deciding: ``options`` (TreeGraft's settings) · ``policies`` (the state a policy sees, its features, the cost model and the rules) ·
``step_rule`` (the default rule, per step, and the per-step learned scheduler) · ``calibration``
(measured acceptance) · ``history`` (the recent steps, for the extended features) · ``costs`` (the warm-up
cost measurement) · ``registry`` (policies by name).

Learning: ``profiler`` and ``cost_profile`` (``treegraft profile``) · ``rollouts`` and ``values`` (the
offline value system, ``treegraft collect``) · ``shards`` (resumable rollout storage) · ``distill`` and
``artifact`` (the MLP, ``treegraft distill``) · ``replay`` (policies re-priced under other costs). No CLI code
here.
"""
