from moecc_runtime.memory.arena import *  # noqa: F401,F403  shim, removed by the lead
