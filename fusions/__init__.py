"""Built-in fusions, one per file, installed as ``fusible.fusions``.

Each file is written as a plugin would be; the registry loads them (by the specs in
``fusible.planning.registry.BUILTIN_FUSIONS``) at the first planning, the way it loads
third-party fusions from the ``fusible.fusions`` entry-point group.
"""
