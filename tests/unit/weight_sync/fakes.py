"""Stand-ins for the staged transports' unit tests (shared memory, collective)."""


class FakeRollout:
    """Records what each sync starts on the engines; every engine confirms at once."""

    def __init__(self):
        self.started = []

    def start_update(self, refs, version, in_flight):
        self.started.append((list(refs), version, in_flight))
        return {f"call-{version}": "rollout-0"}

    def finish_update(self, calls, version, timeout_s):
        pass
