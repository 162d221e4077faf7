"""The scheduler: admits requests into a batch of at most B sequences, owns the KV blocks
(`blocks`: reserved before a step is emitted, preempting when they do not fit) and emits a
plain per-step plan (`step_plan`) for the worker. Request state is `sequence`."""
