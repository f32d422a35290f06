"""A stand-in ``wandb`` module for the logger tests (install with
``monkeypatch.setitem(sys.modules, "wandb", FakeWandb())``)."""


class FakeWandb:
    """Records what it is asked to do: ``inits`` (keyword arguments of each ``init``),
    ``logged`` (``(step, data)`` pairs, data copied) and ``finished`` (``finish`` calls)."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished += 1

    class Image:
        def __init__(self, path):
            self.path = path

        def __eq__(self, other):
            return isinstance(other, FakeWandb.Image) and other.path == self.path
