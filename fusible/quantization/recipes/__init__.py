"""FP8 recipes: the :class:`~fusible.quantization.recipes.base.Recipe` base and its
registry (``base.py``), the built-in recipes' common base (``granularity.py``), the
current-scaling recipes (``current.py``: tensorwise, rowwise), the block recipes
(``blocks.py``: blockwise, MXFP8), the delayed-scaling recipe (``delayed.py``), and the
``autocast`` context with the recipe in effect (``autocast.py``).
"""
