from moecc_runtime.memory.streaming import *  # noqa: F401,F403  shim, removed by the lead
