"""Host adapters: runners that drive a host application's own samplers under the engine's Runner contract.

Each adapter imports its host lazily (inside functions), so `import carnator_engine.hosts.<host>` works
without the host installed; only building a runner needs it.
"""
