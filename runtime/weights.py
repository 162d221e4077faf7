from moecc_runtime.memory.weights import *  # noqa: F401,F403  shim, removed by the lead
