"""Whole-model tools: what works on a user's ``torch.nn`` model rather than on one
pipeline.

Converting a model in place (:mod:`~fusible.models.conversion`, with the rewrites it
makes: merged gated MLPs, residual adds fused into linear layers, their checkpoints kept
under the original names), moving weights between a fusible model and its ``torch.nn``
twin (:mod:`~fusible.models.state_dicts`), and the plan of every fusible group a model
runs (:mod:`~fusible.models.model_plan`). The facade, ``fusible``, exports their public
names; this package sits above ``fusible.ops`` and imports nothing of the facade.
"""
