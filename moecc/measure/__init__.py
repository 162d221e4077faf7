"""Measurement: `profile.py` times this machine's kernels and copies into a hardware profile;
`calibrate.py` runs the runtime on a model and fits the planner's cost model to its steps."""
