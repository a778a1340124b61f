"""Built-in fusions, one per file, installed as ``fusible.fusions``.

Each file is written as a plugin would be, and is one: fusible's distribution advertises
them in the entry-point group ``fusible.fusions`` (pyproject.toml), which the registry loads
at the first planning, third-party fusions alike.
"""
