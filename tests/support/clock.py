"""A clock tests step by hand, for code that takes ``clock=`` (a retry window, a deadline):
the test says when time has passed instead of sleeping through it on a loaded machine."""


class SteppedClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
